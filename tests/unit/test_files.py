"""toolkit.files.write_atomic: all or nothing, text or bytes, the mode open() would give."""

import os
import stat

import pytest

from toolkit.files import write_atomic


def test_text_and_bytes_replace_the_old_content(tmp_path):
    path = tmp_path / "plan.json"
    write_atomic(path, "old\n")
    write_atomic(path, b"\x89PNG new")
    assert path.read_bytes() == b"\x89PNG new" and os.listdir(tmp_path) == ["plan.json"]


def test_the_mode_is_what_open_would_give_not_mkstemps(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "report.html", "<html/>")
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "report.html").stat().st_mode) == stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "metrics.json"
    write_atomic(path, "kept\n")
    with pytest.raises(TypeError):
        write_atomic(path, 12345)  # neither text nor bytes: fails mid-write
    assert path.read_text() == "kept\n" and os.listdir(tmp_path) == ["metrics.json"]
