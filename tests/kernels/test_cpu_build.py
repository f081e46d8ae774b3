"""The C kernel build cache: its key covers every header a kernel includes with quotes."""

from __future__ import annotations

from pathlib import Path

import pytest
from qworker_kernels import cpu_build

pytestmark = pytest.mark.timeout(30)

FLAGS = ("-O3", "-march=native")


def _write_kernel(folder: Path) -> Path:
    (folder / "outer.h").write_text('#include "inner.h"\nstatic inline int outer(void) { return inner(); }\n')
    (folder / "inner.h").write_text("static inline int inner(void) { return 1; }\n")
    (folder / "unrelated.h").write_text("#define UNUSED 1\n")
    source = folder / "kernel.c"
    source.write_text('#include <stdint.h>\n#include "outer.h"\nint qw_entry(void) { return outer(); }\n')
    return source


def test_changing_an_included_header_changes_the_key(tmp_path: Path) -> None:
    source = _write_kernel(tmp_path)
    assert cpu_build.source_closure(source) == [source, tmp_path / "inner.h", tmp_path / "outer.h"]
    before = cpu_build.build_key(source, FLAGS, "gcc 12")
    (tmp_path / "unrelated.h").write_text("#define UNUSED 2\n")
    assert cpu_build.build_key(source, FLAGS, "gcc 12") == before, "a header nobody includes changed the key"
    # A header included through another header counts too.
    (tmp_path / "inner.h").write_text("static inline int inner(void) { return 2; }\n")
    after = cpu_build.build_key(source, FLAGS, "gcc 12")
    assert after != before
    assert cpu_build.build_key(source, (*FLAGS, "-ffp-contract=off"), "gcc 12") != after
    assert cpu_build.build_key(source, FLAGS, "gcc 13") != after


def test_shipped_kernels_include_the_shared_header() -> None:
    folder = Path(cpu_build.__file__).parent
    for name in ("cpu_paged_attention.c", "cpu_prefill_attention.c", "cpu_fused_ops.c"):
        assert folder / "cpu_simd.h" in cpu_build.source_closure(folder / name), name


def test_a_changed_header_is_rebuilt_not_loaded_stale(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QWORKER_CACHE_DIR", str(tmp_path / "cache"))
    source = _write_kernel(tmp_path)
    first = cpu_build.load_c_library(source)
    if first is None:
        pytest.skip("no C compiler")
    assert first.qw_entry() == 1
    (tmp_path / "inner.h").write_text("static inline int inner(void) { return 2; }\n")
    second = cpu_build.load_c_library(source)
    assert second is not None and second.qw_entry() == 2
    assert len(list((tmp_path / "cache").glob("kernels/*/kernel.so"))) == 2


def test_a_library_that_cannot_build_is_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("QWORKER_CACHE_DIR", str(tmp_path))
    library = cpu_build.CKernelLibrary("no_such_kernel.c", {}, errors={})
    assert library.get() is None and not library.is_available()
    with pytest.raises(RuntimeError, match=r"no_such_kernel\.c could not be built"):
        library.require()
