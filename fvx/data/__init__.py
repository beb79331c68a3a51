"""Training data: what a run reads (``datasets``), FastVideo's parquet read and written (``parquet``), batches as a pure
function of the step (``batching``), the parquet made from media and captions (``preprocess``, clips read by
``media``), and the toy video world the CPU defaults train on (``toy_world``, its sound: ``toy_audio``)."""
