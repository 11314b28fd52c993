"""The converter on the worker pool: the same pack bytes for any thread count, each tensor the
bytes the one-thread quantizer makes of the checkpoint's values, a bounded read-ahead, and a
progress line with a rate in parameters per second and an ETA."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest

from colibrid import native
from colibrid.tools.convert.converter import convert
from colibrid.tools.convert.progress import Progress, format_duration
from colibrid.tools.convert.quant_spec import parse_quant
from colibrid.tools.convert.reader import ReadRequest, TensorReader
from colibrid.tools.convert.safetensors import Checkpoint, CheckpointError
from colibrid.models import architecture_for
from colibrid.pack import Pack
from tests.tiny_checkpoints import CheckpointSpec

BF16_SPEC = CheckpointSpec("olmoe", dtype="bfloat16")


@pytest.mark.parametrize("quant", ["q4_g64", "experts=mxfp4,dense=q8_0,embeddings=bf16"])
def test_pack_bytes_do_not_depend_on_the_thread_count(packs, tmp_path, quant):
    checkpoint = packs.checkpoint(BF16_SPEC)
    files = {}
    for n in (1, 2, 3):
        with native.ThreadPool(n) as pool:
            out = tmp_path / f"t{n}"
            convert(checkpoint, out, parse_quant(quant), progress=False, pool=pool)
        files[n] = ((out / "dense.bin").read_bytes(), (out / "experts.bin").read_bytes())
    assert files[1] == files[2] == files[3]


def test_every_tensor_is_the_one_thread_quantizer_of_the_checkpoint_values(packs, tmp_path):
    """What the converter wrote before it ran on the pool: quantize(type, read_f32(name))."""
    checkpoint_dir = packs.checkpoint(BF16_SPEC)
    out = tmp_path / "pack"
    convert(checkpoint_dir, out, parse_quant("experts=q4_g64,dense=q8_0,embeddings=bf16"), progress=False)
    pack = Pack.open(out)
    ck = Checkpoint(checkpoint_dir)
    import json

    hf_config = json.loads((checkpoint_dir / "config.json").read_text())
    arch = architecture_for(hf_config)
    config = arch.model_config(hf_config)
    checked = 0
    for pack_name, hf_name in arch.dense_tensor_names(config, arch.optional_tensors(hf_config)).items():
        tensor = pack.dense(pack_name)
        values = ck.read_f32(hf_name)
        want = values if values.ndim == 1 else native.quantize(tensor.type, values)
        assert np.asarray(tensor.data).tobytes() == np.asarray(want).tobytes(), pack_name
        checked += values.ndim == 2
    assert checked >= 4
    from colibrid.engine.experts.source import PreadExpertSource

    source = PreadExpertSource(pack)
    try:
        names = arch.expert_tensor_names(config.moe_layer_ids[-1], 3)
        expert = source.get(config.moe_layer_ids[-1], 3)
        for part in ("gate", "up", "down"):
            got = getattr(expert, part)
            assert got.type is native.TensorType.Q4_G64
            want = native.quantize(native.TensorType.Q4_G64, ck.read_f32(getattr(names, part)))
            assert np.asarray(got.data).tobytes() == want.tobytes(), part
    finally:
        source.close()


def test_reader_holds_at_most_the_read_ahead_plus_the_tensor_in_use(packs):
    ck = Checkpoint(packs.checkpoint(BF16_SPEC))
    names = sorted(n for n, info in ck.tensors.items() if len(info.shape) == 2)
    largest = max(ck.source_matrix(n).nbytes for n in names)
    with TensorReader(ck, [ReadRequest(n) for n in names], depth=1) as reader:
        seen = []
        for loaded in reader:
            assert loaded.data.tobytes() == np.ascontiguousarray(ck._raw(ck.info(loaded.request.ref))).tobytes()
            seen.append(loaded.request.ref)
    assert seen == names
    # the one in use, one waiting in the queue, one read and waiting for room in it
    assert largest <= reader.peak_bytes <= 3 * largest


def test_reader_raises_a_read_error_where_its_tensor_comes_and_stops_early(packs, tmp_path):
    ck = Checkpoint(packs.checkpoint(BF16_SPEC))
    names = sorted(n for n, info in ck.tensors.items() if len(info.shape) == 2)
    with TensorReader(ck, [ReadRequest(names[0]), ReadRequest("no.such.tensor"), ReadRequest(names[1])]) as reader:
        tensors = iter(reader)
        assert next(tensors).request.ref == names[0]
        with pytest.raises(CheckpointError, match="no.such.tensor"):
            next(tensors)
    before = threading.active_count()
    with TensorReader(ck, [ReadRequest(n) for n in names]) as reader:
        next(iter(reader))  # leave after the first: the thread must not hang on its full queue
    assert threading.active_count() <= before


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_shows_the_rate_in_params_per_second_and_the_time_left():
    clock, stream = FakeClock(), io.StringIO()
    progress = Progress(1_000_000_000, "converting x", stream=stream, enabled=True, clock=clock)
    assert progress.eta_s() is None
    clock.now += 10.0
    progress.advance(250_000_000, "layer 3 expert 7")
    assert progress.rate_params_per_s() == pytest.approx(25e6)
    assert progress.eta_s() == pytest.approx(30.0)
    line = stream.getvalue()
    assert "25.0 M params/s" in line and "ETA    30s" in line and " 25.0%" in line and "layer 3 expert 7" in line
    clock.now += 3600.0
    progress.advance(250_000_000)
    assert progress.eta_s() == pytest.approx(3610.0)
    assert "ETA  1h00m" in stream.getvalue()


def test_durations_read_at_every_scale():
    assert [format_duration(s) for s in (0, 42.4, 185, 3599, 7620, 60_000)] == ["0s", "42s", "3m05s", "59m59s", "2h07m", "16h40m"]


def test_a_silent_progress_writes_nothing():
    stream = io.StringIO()
    progress = Progress(10, "x", stream=stream, enabled=False)
    progress.advance(10)
    progress.close()
    assert stream.getvalue() == ""
