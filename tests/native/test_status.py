"""libcolibri's status codes, read from colibri.h itself: one enum col_status holds every
code, col_status_string names each one, and colibrid.native turns each into its own
exception carrying that text. A code added to the enum without a text, a Python class or a
Status member fails here."""

import re
from pathlib import Path

import pytest

from colibrid import native

HEADER = Path(__file__).resolve().parents[2] / "libcolibri" / "include" / "colibri.h"


def header_text() -> str:
    return HEADER.read_text()


def status_enum() -> dict[str, int]:
    """The members of enum col_status as written in colibri.h: {"COL_OK": 0, ...}."""
    bodies = re.findall(r"enum\s+col_status\s*\{(.*?)\};", header_text(), re.S)
    assert len(bodies) == 1, "colibri.h must declare enum col_status exactly once"
    body = re.sub(r"/\*.*?\*/", "", bodies[0], flags=re.S)  # the comments hold words like "COL_OK"
    members = dict(re.findall(r"\b(COL_\w+)\s*=\s*(\d+)", body))
    assert len(members) == body.count(","), "every member of enum col_status has an explicit value"
    return {name: int(value) for name, value in members.items()}


def test_colibri_h_is_one_guarded_header_with_no_status_outside_the_enum():
    text = header_text()
    assert re.findall(r"^#ifndef (\w+)", text, re.M) == ["COLIBRI_H"]
    assert text.rstrip().endswith("#endif /* COLIBRI_H */")
    assert not re.search(r"^#define COL_E\w*", text, re.M), "status codes belong in enum col_status"
    codes = status_enum()
    assert codes["COL_OK"] == 0
    assert sorted(codes.values()) == list(range(len(codes))), "codes are 0..n-1, each once"


def test_every_status_code_has_its_own_text():
    lib = native._lib()
    texts = {name: lib.col_status_string(code).decode() for name, code in status_enum().items()}
    unknown = lib.col_status_string(max(status_enum().values()) + 1).decode()
    assert unknown == "unknown status"
    assert [name for name, text in texts.items() if text == unknown or not text] == []
    assert len(set(texts.values())) == len(texts), f"two codes share a text: {texts}"


def test_python_mirrors_the_enum():
    assert {f"COL_{member.name}": int(member) for member in native.Status} == status_enum()


@pytest.mark.parametrize("name, code", sorted(status_enum().items(), key=lambda item: item[1]))
def test_each_status_becomes_its_own_exception_with_the_c_text(name, code):
    if code == 0:
        assert native.check(code, "anything") is None
        return
    text = native._lib().col_status_string(code).decode()
    assert text != "unknown status"
    with pytest.raises(native.ColibriError) as info:
        native.check(code, "the call (its arguments)")
    error = info.value
    assert type(error) is not native.ColibriError, f"{name} has no exception class of its own"
    assert error.status == code and type(error).status == code
    assert str(error) == f"the call (its arguments): {text} (status {code})"


def test_an_errno_reported_with_a_status_is_spelled_out():
    with pytest.raises(native.ReadError, match=r"^open x: I/O error \(status 5\): No such file or directory \(errno 2\)$"):
        native.check(native.Status.EIO, "open x", 2)


def test_a_code_the_library_does_not_know_is_a_plain_colibri_error():
    code = max(status_enum().values()) + 1
    with pytest.raises(native.ColibriError, match=rf"^call: unknown status \(status {code}\)$") as info:
        native.check(code, "call")
    assert type(info.value) is native.ColibriError and info.value.status == code


def test_the_expert_cache_raises_through_the_same_path(tmp_path):
    with pytest.raises(native.ReadError) as info:
        native.Loader(tmp_path / "missing.bin")
    text = native._lib().col_status_string(native.Status.EIO).decode()
    assert f"{tmp_path / 'missing.bin'} for expert reads: {text} (status 5): No such file or directory" in str(info.value)
    slab = native.Slab(4096, 1, hugetlb=native.AepcMode.OFF, thp=native.AepcMode.OFF, lock=native.AepcMode.OFF)
    try:
        slab.alloc()
        with pytest.raises(native.NoFreeSlotError, match=r"no free or evictable slot \(status 7\)"):
            slab.alloc()
    finally:
        slab.close()
