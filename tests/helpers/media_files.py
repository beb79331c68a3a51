"""Media files the preprocessing tests read: clips with a sine sound track (PyAV), the toy world's files of a kind
and copies of a folder to change."""
import pathlib

import numpy as np


def write_with_sound(path, seconds=1.0, fps=16, rate=8000, pitch=440.0, sound=True):
    """A grey clip with (``sound``) a stereo sine track, as an mp4 (H.264 + AAC)."""
    import av
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width = video.height = 16
        video.pix_fmt = "yuv420p"
        audio = container.add_stream("aac", rate=rate, layout="stereo") if sound else None
        for _ in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.full((16, 16, 3), 128, np.uint8), format="rgb24")
            container.mux(video.encode(frame))
        container.mux(video.encode(None))
        if sound:
            t = np.arange(int(seconds * rate)) / rate
            wave = np.stack([np.sin(2 * np.pi * pitch * t)] * 2).astype(np.float32) * 0.5
            chunk = 1024
            for start in range(0, wave.shape[1], chunk):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start:start + chunk]), format="fltp",
                                                   layout="stereo")
                frame.sample_rate, frame.pts = rate, start
                container.mux(audio.encode(frame))
            container.mux(audio.encode(None))


def world_files(folder: pathlib.Path, kind: str, samples: int = 4) -> pathlib.Path:
    """``write-videos --kind KIND``: the toy world's clips with the files the kind reads beside them, in ``folder``."""
    from fvx.data import toy_world

    assert toy_world.main(["write-videos", str(folder), "--samples", str(samples), "--kind", kind]) == 0
    return folder


def copy_of(folder: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """The files of ``folder`` copied into a new folder ``root`` (to remove or add one)."""
    root.mkdir()
    for path in folder.iterdir():
        (root / path.name).write_bytes(path.read_bytes())
    return root
