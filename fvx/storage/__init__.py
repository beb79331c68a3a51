"""What fvx writes and reads back: checkpoints (``checkpoint``: the manager; ``checkpoint_config``: when a run saves;
``shard_files``: the format; ``legacy_checkpoint``: reading older formats) and durable small files (``files``)."""
