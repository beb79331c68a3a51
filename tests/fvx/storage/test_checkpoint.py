"""fvx.storage.checkpoint: exact round trips, async saves that in-place updates cannot spoil, retention, interrupted
saves, strict restores, corruption named, no unpickling."""
import pathlib
import pickle
import shutil
import threading

import pytest
import torch

from fvx.core import optim, random, tree
from fvx.core.state import RoleState, TrainState
from fvx.storage import checkpoint, checkpoint_config, shard_files
from fvx.storage.checkpoint import CheckpointConfig, CheckpointError, Checkpoints


def make_state(step: int = 5, *, ema: bool = False, shape=(6, 5)) -> TrainState:
    """A state like a method's: fp32 and bf16 params, an AdamW state (with an EmptyState), optional EMA."""
    k = random.split(random.key(step), 3)
    params = {"blocks.0.attn.to_q.weight": random.normal(k[0], shape),
              "norm.bias": random.normal(k[1], (shape[-1],)).bfloat16()}
    tx = optim.adamw(1e-3)
    opt_state = tx.init(params)
    torch._foreach_add_(tree.tensor_leaves(opt_state[0].mu), 0.5)
    opt_state[0].count.fill_(step)
    opt_state[2].count.fill_(step)
    role = RoleState(params, opt_state, tree.map_tensors(lambda p: p * 0.5, params) if ema else None)
    return TrainState(torch.tensor(step), random.fold_in(k[2], 1), {"student": role})


def assert_same(a, b):
    named_a, named_b = checkpoint.leaves_by_name(a), checkpoint.leaves_by_name(b)
    assert list(named_a) == list(named_b)
    for name, x in named_a.items():
        y = named_b[name]
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


def save(directory, state, **knobs):
    with Checkpoints(directory, CheckpointConfig(**knobs)) as checkpoints:
        assert checkpoints.save(state, config={"config": {"seed": 1}}, meta={"world_size": 1})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_round_trip_is_exact_and_keeps_types(tmp_path, async_save):
    state = make_state(ema=True)
    save(tmp_path, state, async_save=async_save)
    with Checkpoints(tmp_path) as checkpoints:
        assert checkpoints.steps() == [5]
        restored = checkpoints.restore(5, make_state(0, ema=True))
        assert checkpoints.read_json(5, "meta") == {"world_size": 1, "step": 5}
        assert checkpoints.read_json(5, "config") == {"config": {"seed": 1}}
        ema = checkpoints.read(5, ("roles", "student", "ema"))
    assert_same(restored, state)
    assert type(restored) is TrainState and type(restored.roles["student"].opt_state[0]) is optim.ScaleByAdamState
    assert restored.roles["student"].opt_state[1] == optim.EmptyState()
    assert_same(ema, state.roles["student"].ema)


def test_async_save_writes_the_state_as_it_was_when_saved(tmp_path, monkeypatch):
    """The donating step updates tensors in place right after a save returns: the background write must not see it.
    The write is held back until the test has updated every tensor of the state in place."""
    gate = threading.Event()
    write = shard_files.write

    def gated(folder, *args):
        gate.wait(60)
        write(folder, *args)

    monkeypatch.setattr(shard_files, "write", gated)
    state = make_state()
    expected = tree.map_tensors(torch.clone, state)
    with Checkpoints(tmp_path, CheckpointConfig(async_save=True)) as checkpoints:
        checkpoints.save(state, config={}, meta={})
        assert checkpoints.steps() == []  # still being written
        torch._foreach_add_(tree.tensor_leaves(state), 1)  # what the next steps do
        gate.set()
        checkpoints.wait()
        assert checkpoints.steps() == [5]
        assert_same(checkpoints.restore(5, make_state(0)), expected)


def test_retention_keeps_the_latest_and_every_mth(tmp_path):
    config = CheckpointConfig(keep_latest=2, keep_every=3, async_save=False)
    with Checkpoints(tmp_path, config) as checkpoints:
        for step in range(1, 9):
            checkpoints.save(make_state(step), config={}, meta={})
        assert checkpoints.steps() == [3, 6, 7, 8]
        assert not checkpoints.save(make_state(8), config={}, meta={})  # a step is never saved twice
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "6", "7", "8"]


def test_due_saves_every_nth_and_the_last_step_once():
    config = CheckpointConfig(every=3)
    assert [s for s in range(1, 11) if checkpoint_config.due(config, s, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 10) if checkpoint_config.due(config, s, 9)] == [3, 6, 9]
    assert [s for s in range(1, 10) if checkpoint_config.due(CheckpointConfig(every=0, final=False), s, 9)] == []


def test_an_interrupted_save_is_never_picked_up(tmp_path):
    """A save killed before orbax's final rename leaves <step>.orbax-checkpoint-tmp: a complete-looking copy here."""
    save(tmp_path, make_state(4))
    shutil.copytree(tmp_path / "4", tmp_path / f"6{checkpoint.TMP_SUFFIX}")
    with Checkpoints(tmp_path) as checkpoints:
        assert checkpoints.steps() == [4] and checkpoints.latest() == 4
        with pytest.raises(CheckpointError, match="no checkpoint of step 6"):
            checkpoints.restore(6, make_state(0))
    with Checkpoints(tmp_path, CheckpointConfig()) as writer:  # a writer deletes it and can save step 6 again
        assert not (tmp_path / f"6{checkpoint.TMP_SUFFIX}").exists()
        writer.save(make_state(6), config={}, meta={})
    assert Checkpoints(tmp_path).steps() == [4, 6]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_committed_checkpoint_is_flushed_before_its_marker(tmp_path, monkeypatch, async_save):
    """Every file and folder of a step is fsync'ed, then the commit marker; a step folder without the marker (orbax
    finished, fvx did not commit: a crash between the two) is not a checkpoint, and the next writer clears it."""
    synced = []
    real = checkpoint.os.fsync
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (synced.append(checkpoint.os.readlink(f"/proc/self/fd/{fd}")),
                                                            real(fd))[1])
    directory = tmp_path / "ckpt"
    save(directory, make_state(4), async_save=async_save)
    step_dir = directory / "4"
    files = {str(p) for p in step_dir.rglob("*") if p.is_file()}
    assert files <= set(synced) and str(step_dir / checkpoint.COMMIT_FILE) in synced
    assert synced.index(str(step_dir / checkpoint.COMMIT_FILE)) > max(synced.index(f) for f in files - {
        str(step_dir / checkpoint.COMMIT_FILE)})
    assert str(step_dir) in synced and str(directory) in synced  # the directory entries too
    (step_dir / checkpoint.COMMIT_FILE).unlink()  # as if the process died before committing
    with Checkpoints(directory) as reader:
        assert reader.steps() == []
    with Checkpoints(directory, CheckpointConfig(async_save=False)):
        assert not step_dir.exists()


def test_restore_lists_every_mismatch(tmp_path):
    save(tmp_path, make_state())
    other = make_state(shape=(6, 7))
    other.roles["student"].params["extra.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as error, Checkpoints(tmp_path) as checkpoints:
        checkpoints.restore(5, other)
    message = str(error.value)
    assert "missing in the checkpoint (1): roles.student.params.extra.weight" in message
    assert "roles.student.params.blocks.0.attn.to_q.weight: checkpoint [6, 5] float32, run [6, 7] float32" in message
    assert "roles.student.params.norm.bias: checkpoint [5] bfloat16, run [7] bfloat16" in message


def largest_data_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((step_dir / "shards").glob("*.safetensors"), key=lambda p: p.stat().st_size)


def test_corrupt_and_truncated_checkpoints_name_the_culprit(tmp_path):
    save(tmp_path, make_state(shape=(64, 64)))
    data = largest_data_file(tmp_path / "5")
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x01
    data.write_bytes(bytes(content))
    with pytest.raises(CheckpointError, match=r"shard file '.*/5/shards/rank-00000-of-00001\.safetensors': tensor "
                                              r"'roles/student/[\w./]+' fails its checksum"):
        Checkpoints(tmp_path).restore(5, make_state(0, shape=(64, 64)))
    data.write_bytes(bytes(content[: len(content) // 3]))
    with pytest.raises(CheckpointError, match=r"checkpoint '.*/5' is corrupt or truncated: shard file "
                                              r"'.*/5/shards/rank-00000-of-00001\.safetensors': unreadable header"):
        Checkpoints(tmp_path).restore(5, make_state(0, shape=(64, 64)))
    (tmp_path / "5" / "meta" / "metadata").write_text('{"step": ')
    with pytest.raises(CheckpointError, match=r"file '.*/5/meta/metadata' is corrupt or truncated"):
        Checkpoints(tmp_path).restore(5, make_state(0, shape=(64, 64)))


def test_loading_unpickles_nothing(tmp_path, monkeypatch):
    save(tmp_path, make_state(ema=True))

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load must not unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    with Checkpoints(tmp_path) as checkpoints:
        assert_same(checkpoints.restore(5, make_state(0, ema=True)), make_state(ema=True))


def test_bad_input(tmp_path):
    assert Checkpoints(tmp_path / "none").steps() == []
    with pytest.raises(CheckpointError, match="opened for reading"):
        Checkpoints(tmp_path).save(make_state(), config={}, meta={})
    with pytest.raises(TypeError, match="'roles.student.params.lr' is a float"), \
            Checkpoints(tmp_path, CheckpointConfig()) as checkpoints:
        state = make_state()
        state.roles["student"].params["lr"] = 0.1
        checkpoints.save(state, config={}, meta={})


@pytest.mark.cuda
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_gpu_state_round_trips_onto_the_gpu(tmp_path, async_save):
    save(tmp_path, tree.to_device(make_state(ema=True), "cuda"), async_save=async_save)
    with Checkpoints(tmp_path) as checkpoints:
        restored = checkpoints.restore(5, tree.to_device(make_state(0, ema=True), "cuda"))
    assert all(t.is_cuda for t in tree.tensor_leaves(restored))
    assert_same(tree.to_device(restored, "cpu"), make_state(ema=True))


def rank_pieces(state, index: int, count: int) -> dict:
    """Rank ``index`` of ``count``'s pieces of ``state`` as processes write them: its rows of every 2-D tensor, and on
    rank 0 every other tensor whole."""
    pieces = {}
    for path, tensor in tree.named_leaves(state):
        record = {"shape": list(tensor.shape), "dtype": str(tensor.dtype), "dim": None, "start": 0, "stop": 0}
        if tensor.dim() == 2:
            rows = tensor.shape[0] // count
            part = tensor[index * rows:(index + 1) * rows].contiguous()
            pieces["/".join(path)] = (part, {**record, "dim": 0, "start": index * rows, "stop": (index + 1) * rows})
        elif index == 0:
            pieces["/".join(path)] = (tensor.contiguous(), record)
    return pieces


def flip_a_data_byte(file: pathlib.Path) -> None:
    content = bytearray(file.read_bytes())
    content[-3] ^= 0x01  # in the last tensor's bytes (the JSON header comes first)
    file.write_bytes(bytes(content))


def test_one_process_and_several_write_one_format_read_by_one_reader(tmp_path):
    """A single process writes the one-rank case of the shard files; a state two ranks wrote (its 2-D tensors cut by
    rows into two files, as two processes write them) reads through the same reader into whole tensors; a flipped
    byte in either is refused naming the file and the tensor."""
    state = make_state(shape=(6, 5))
    save(tmp_path / "one", state, async_save=False)
    one = tmp_path / "one" / "5" / "shards"
    assert sorted(p.name for p in one.glob("*.safetensors")) == ["rank-00000-of-00001.safetensors"]
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    two = tmp_path / "two" / "5" / "shards"
    (two / "rank-00000-of-00001.safetensors").unlink()
    for index in range(2):
        shard_files.write(two, rank_pieces(state, index, 2), index, 2)
    with Checkpoints(tmp_path / "one") as single, Checkpoints(tmp_path / "two") as sharded:
        assert not single.is_sharded(5) and sharded.is_sharded(5)
        assert_same(single.restore(5, make_state(0)), state)
        assert_same(sharded.restore(5, make_state(0)), state)
    for file in (one / "rank-00000-of-00001.safetensors", two / "rank-00001-of-00002.safetensors"):
        flip_a_data_byte(file)
        with pytest.raises(CheckpointError, match=rf"checkpoint '{file.parents[1]}' is corrupt or truncated: shard "
                                                  rf"file '{file}': tensor 'roles/student/[\w/.]+' fails its checksum"):
            Checkpoints(file.parents[2]).restore(5, make_state(0))


def test_adamw_state_as_fvx_0_1_saved_it_restores_into_the_chain_state(tmp_path):
    """fvx 0.1 saved AdamW's state as one (count, mu, nu); it restores into today's chain state (ScaleByAdamState,
    EmptyState, ScaleByScheduleState), both counts from the one (fvx.storage.legacy_checkpoint.stored_name)."""
    state = make_state()
    adam = state.roles["student"].opt_state[0]
    then = state._replace(roles={"student": state.roles["student"]._replace(
        opt_state={"count": adam.count, "mu": adam.mu, "nu": adam.nu})})
    save(tmp_path, then)
    with Checkpoints(tmp_path) as checkpoints:
        assert "roles.student.opt_state.count" in checkpoints.specs(5)
        assert_same(checkpoints.restore(5, make_state(0)), state)


def test_a_flipped_byte_in_a_shard_files_header_or_a_record_is_refused_by_name(tmp_path):
    """The header of a shard file (what each piece is) and the JSON records saved beside the state carry CRCs too: a
    change that leaves them valid JSON is refused as damage, naming the file."""
    save(tmp_path, make_state())
    file = tmp_path / "5" / "shards" / "rank-00000-of-00001.safetensors"
    content = file.read_bytes()
    assert b'start\\": 0' in content  # the JSON of the pieces, a string in the safetensors header
    file.write_bytes(content.replace(b'start\\": 0', b'start\\": 1', 1))
    with pytest.raises(CheckpointError, match=rf"shard file '{file}': its header fails its checksum"):
        Checkpoints(tmp_path).restore(5, make_state(0))
    file.write_bytes(content)
    meta = tmp_path / "5" / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(CheckpointError, match=rf"checkpoint file '{meta}' is corrupt: it fails the checksum"):
        Checkpoints(tmp_path).read_json(5, "meta")


def test_a_flipped_bit_anywhere_in_a_saved_config_is_refused_or_changes_nothing(tmp_path):
    """Every byte of the config record, one bit flipped at a time: read_json refuses it (naming the file), or the
    flip left the same record (``1e-05`` and ``1E-05`` are one number)."""
    config = {"config": {"method": {"optim": {"lr": 0.003, "eps": 1e-05}, "roles": {"student": "student"}},
                         "run": {"seed": 1, "steps": 10, "output_dir": "runs/x"}}}
    with Checkpoints(tmp_path, CheckpointConfig(async_save=False)) as checkpoints:
        checkpoints.save(make_state(), config=config, meta={"world_size": 1})
    path = tmp_path / "5" / "config" / "metadata"
    original = path.read_bytes()
    with Checkpoints(tmp_path) as checkpoints:
        for position in range(len(original)):
            flipped = bytearray(original)
            flipped[position] ^= 0x01
            path.write_bytes(bytes(flipped))
            try:
                assert checkpoints.read_json(5, "config") == config, position
            except CheckpointError as error:
                assert str(path) in str(error)
