"""Every number in a manifest is checked before it is used: offsets, lengths, alignment,
shapes and types against the model and the files, the expert index row by row, and the
JSON itself. A corrupt manifest is refused at open with an error naming the tensor (or
expert) and the file; nothing is read from the wrong place."""

from __future__ import annotations

import shutil

import pytest

from tests.pack.conftest import assert_refused_after
from tests.tiny_checkpoints import CheckpointSpec

SPEC = CheckpointSpec("olmoe")
QUANT = "experts=q8_0,dense=f16,embeddings=f16"  # f16 has a same-size twin (bf16) to swap it for


@pytest.fixture(scope="module")
def source_pack(packs):
    return packs.pack(SPEC, QUANT)


@pytest.fixture
def pack_copy(source_pack, tmp_path):
    return shutil.copytree(source_pack, tmp_path / "pack")


def _tensor(m, name="layers.0.attn.q"):
    return m["dense"]["tensors"][name]


def _row(m, number=3):
    return m["experts"]["index"][number]


def _set(getter, key, value):
    def mutate(m):
        getter(m)[key] = value(getter(m), m) if callable(value) else value
    return mutate


def _swap_rows(m):
    index = m["experts"]["index"]
    index[2], index[3] = index[3], index[2]


Q = "dense tensor 'layers.0.attn.q' in dense.bin"
K = "dense tensor 'layers.0.attn.k' in dense.bin"
ROW3 = "expert 3 of layer 0 in experts.bin"

# (case, mutation of the manifest's JSON, fragments the error must contain)
CORRUPTIONS = [
    ("negative dense offset", _set(_tensor, "offset", -4096), [Q, "offset is -4096"]),
    ("offset past 64 bits", _set(_tensor, "offset", 1 << 64), [Q, "offset"]),
    ("tensor past the end of dense.bin", _set(_tensor, "offset", lambda t, m: -(-m["dense"]["size"] // 4096) * 4096),
     [Q, "past the end of dense.bin"]),
    ("unaligned offset", _set(_tensor, "offset", lambda t, m: t["offset"] + 64), [Q, "not a multiple of the alignment"]),
    ("overlapping tensors", _set(lambda m: _tensor(m, "layers.0.attn.k"), "offset", lambda t, m: _tensor(m)["offset"]),
     ["overlaps", "layers.0.attn"]),
    ("nbytes too large", _set(_tensor, "nbytes", lambda t, m: t["nbytes"] + 2), [Q, "nbytes"]),
    ("negative nbytes", _set(_tensor, "nbytes", -1), [Q, "nbytes"]),
    ("zero dimension", _set(_tensor, "shape", [0, 64]), [Q, "shape dimension"]),
    ("negative dimension", _set(_tensor, "shape", [-64, -64]), [Q, "shape dimension"]),
    ("huge dimension", _set(_tensor, "shape", [1 << 40, 64]), [Q, "shape dimension"]),
    ("three dimensions", _set(_tensor, "shape", [2, 32, 64]), [Q, "shape"]),
    ("shape transposed, same byte size", _set(lambda m: _tensor(m, "layers.0.attn.k"), "shape", [64, 32]),
     [K, "shape [64, 32], the model needs [32, 64]"]),
    ("unknown type", _set(_tensor, "type", "q3_k"), [Q, "unknown type 'q3_k'"]),
    ("type swapped for one of the same size", _set(_tensor, "type", "bf16"), [Q, "type bf16", "stores it as f16"]),
    ("router quantized", _set(lambda m: _tensor(m, "layers.1.router"), "type", "f16"),
     ["dense tensor 'layers.1.router' in dense.bin", "stores it as f32"]),
    ("offset as a float", _set(_tensor, "offset", lambda t, m: float(t["offset"])), [Q, "must be an integer"]),
    ("nbytes as a bool", _set(_tensor, "nbytes", True), [Q, "must be an integer"]),
    ("offset as a string", _set(_tensor, "offset", "0"), [Q, "must be an integer"]),
    ("crc32c out of range", _set(_tensor, "crc32c", 1 << 32), [Q, "crc32c"]),
    ("missing tensor", lambda m: _tensor(m, "layers.1.ffn_norm") and m["dense"]["tensors"].pop("layers.1.ffn_norm"),
     ["tensor 'layers.1.ffn_norm' of dense.bin is missing"]),
    ("unknown tensor", lambda m: m["dense"]["tensors"].update({"layers.9.attn.q": _tensor(m)}),
     ["tensor 'layers.9.attn.q' in dense.bin is not one this model has"]),
    ("negative alignment", lambda m: m.update(alignment=-4096), ["alignment"]),
    ("zero alignment", lambda m: m.update(alignment=0), ["alignment"]),
    ("alignment not a power of two", lambda m: m.update(alignment=6144), ["alignment 6144 is not a power of two"]),
    ("alignment below 4096", lambda m: m.update(alignment=64), ["alignment 64 is not a power of two in [4096"]),
    ("expert offset negative", _set(_row, 2, -4096), ["experts.bin index row 3: offset"]),
    ("expert offset unaligned", _set(_row, 2, lambda r, m: r[2] + 64), [ROW3, "offset"]),
    ("expert record past the end", _set(lambda m: m["experts"]["index"][-1], 3, lambda r, m: r[3] * 2),
     ["expert 7 of layer 1 in experts.bin", "past the end of experts.bin"]),
    ("expert length not a multiple of the alignment", _set(_row, 3, lambda r, m: r[3] - 64), [ROW3, "length"]),
    ("expert crc32c as a string", _set(_row, 4, "0"), ["experts.bin index row 3: crc32c must be an integer"]),
    ("expert crc32c as a float", _set(_row, 4, 1.5), ["experts.bin index row 3: crc32c must be an integer"]),
    ("expert layer out of order", _swap_rows, ["experts.bin index row 2 is expert 3 of layer 0"]),
    ("expert row too short", lambda m: _row(m).pop(), ["experts.bin index row 3 must be a list"]),
    ("expert part overlapping", _set(lambda m: m["experts"]["parts"]["up"], "offset", 0),
     ["expert part 'up' in experts.bin overlaps expert part 'gate'"]),
    ("expert part type swapped", _set(lambda m: m["experts"]["parts"]["down"], "type", "q4_g64"),
     ["expert part 'down' in experts.bin", "stores it as q8_0"]),
    ("model dimension as a float", lambda m: m["model"].update(hidden_size=64.0), ["model.hidden_size must be an integer"]),
    ("model with no vocabulary", lambda m: m["model"].update(vocab_size=0), ["model.vocab_size"]),
    ("model with 2**40 experts", lambda m: m["model"].update(num_experts=1 << 40), ["model.num_experts"]),
    ("more active experts than experts", lambda m: m["model"].update(num_experts_per_tok=9), ["num_experts_per_tok 9"]),
    ("router groups leaving too few experts", lambda m: m["model"].update(router_groups=8, router_groups_kept=1),
     ["model.num_experts_per_tok", "groups kept"]),
    ("router groups as a float", lambda m: m["model"].update(router_groups=2.0), ["model.router_groups must be an integer"]),
    ("routed scaling factor negative", lambda m: m["model"].update(routed_scaling_factor=-2.5),
     ["model.routed_scaling_factor"]),
    ("router choice bias as a number", lambda m: m["model"].update(router_choice_bias=1), ["model.router_choice_bias"]),
    ("rotary dims as a float", lambda m: m["model"].update(rotary_dim=8.0), ["model.rotary_dim"]),
    ("tokenizer file outside the pack", lambda m: m.update(tokenizer_files=["../../etc/passwd"]),
     ["tokenizer_files", "not a plain file name"]),
    ("quantization of an unknown class", lambda m: m["quantization"].update(router="f16"), ["quantization must map"]),
]


@pytest.mark.parametrize("mutate, fragments", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_manifest_is_refused_naming_what(pack_copy, mutate, fragments):
    assert_refused_after(pack_copy, mutate, fragments)


RAW_CORRUPTIONS = [
    ("NaN", lambda text: text.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'), "NaN"),
    ("a key given twice", lambda text: text.replace('"alignment": 4096', '"alignment": 4096, "alignment": 8192'),
     "'alignment' appears twice"),
    ("nested a million deep", lambda text: "[" * 1_000_000 + "]" * 1_000_000, "unreadable manifest"),
    ("not UTF-8", lambda text: text.replace('"producer"', '"produ\udcffcer"'), "not UTF-8"),
]


@pytest.mark.parametrize("rewrite, fragment", [c[1:] for c in RAW_CORRUPTIONS], ids=[c[0] for c in RAW_CORRUPTIONS])
def test_malformed_json_is_refused(pack_copy, rewrite, fragment):
    from colibrid.pack import Pack, PackError

    path = pack_copy / "manifest.json"
    text = rewrite(path.read_text())
    assert text != path.read_text()
    path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    with pytest.raises(PackError, match="manifest") as info:
        Pack.open(pack_copy)
    assert fragment in str(info.value)


def test_oversized_manifest_is_refused_before_it_is_read(pack_copy):
    from colibrid.pack import Pack, PackError
    from colibrid.pack.manifest import MAX_MANIFEST_BYTES

    with open(pack_copy / "manifest.json", "r+b") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(PackError, match=f"a manifest has at most {MAX_MANIFEST_BYTES}"):
        Pack.open(pack_copy)


def test_manifest_symlink_is_not_followed(pack_copy, tmp_path):
    from colibrid.pack import Pack, PackError

    real = tmp_path / "elsewhere.json"
    shutil.move(pack_copy / "manifest.json", real)
    (pack_copy / "manifest.json").symlink_to(real)
    with pytest.raises(PackError, match="cannot open the manifest"):
        Pack.open(pack_copy)


def test_the_unmodified_pack_opens(source_pack):
    from colibrid.pack import Pack

    pack = Pack.open(source_pack)
    assert pack.manifest.dense_tensors["layers.0.attn.q"].type == "f16"
    assert pack.notes == []


# A latent-attention pack (DeepSeek-V3): its mla fields are checked like the others.
DEEPSEEK_SPEC = CheckpointSpec("deepseek_v3")


def _mla(**fields):
    return lambda m: m["model"]["mla"].update(fields)


MLA_CORRUPTIONS = [
    ("latent rank as a float", _mla(kv_lora_rank=64.0), ["model.mla.kv_lora_rank must be an integer"]),
    ("odd rope dims", _mla(qk_rope_head_dim=15), ["model.mla.qk_rope_head_dim"]),
    ("negative softmax scale", _mla(softmax_scale=-0.1), ["model.mla.softmax_scale"]),
    ("rope layout as a number", _mla(rope_interleaved=1), ["model.mla.rope_interleaved"]),
    ("an unknown mla key", _mla(kv_heads=2), ["malformed manifest"]),
    ("grouped kv heads", lambda m: m["model"].update(num_kv_heads=2), ["latent attention needs"]),
    ("another latent rank", _mla(kv_lora_rank=32), ["layers.0.attn.kv_a", "shape"]),
    ("no latent attention", lambda m: m["model"].update(mla=None), ["tensor 'layers.0.attn.q' of dense.bin is missing"]),
]


@pytest.mark.parametrize("mutate, fragments", [c[1:] for c in MLA_CORRUPTIONS], ids=[c[0] for c in MLA_CORRUPTIONS])
def test_corrupt_latent_attention_fields_are_refused(packs, tmp_path, mutate, fragments):
    from colibrid.pack import Pack

    pack = shutil.copytree(packs.pack(DEEPSEEK_SPEC, "f32"), tmp_path / "pack")
    assert Pack.open(pack).manifest.model.mla is not None
    assert_refused_after(pack, mutate, fragments)
