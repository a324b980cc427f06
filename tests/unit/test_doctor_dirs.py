"""doctor's O_DIRECT check creates nothing: an SSD directory that does not exist yet is probed
where it would be made, and serve's ``{replica}`` template is recognised as one (it once left a
directory literally named ``w{replica}`` behind)."""

import os

from dynamo_flexkv.doctor import Status, check_o_direct


def tree(root) -> list:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files)


def test_a_serve_template_is_probed_where_its_replicas_would_be_made(tmp_path):
    check = check_o_direct(f"{tmp_path}/ssd/w{{replica}}")
    assert tree(tmp_path) == []
    assert check.status in (Status.OK, Status.FALLBACK)
    assert "serve template" in check.detail and f"probed {tmp_path}," in check.detail, check.detail


def test_a_missing_directory_is_not_created(tmp_path):
    check = check_o_direct(f"{tmp_path}/a/b")
    assert tree(tmp_path) == []
    assert f"probed {tmp_path}, where {tmp_path}/a/b would be made" in check.detail, check.detail


def test_an_existing_directory_is_probed_itself_and_left_as_it_was(tmp_path):
    check = check_o_direct(str(tmp_path))
    assert tree(tmp_path) == []
    assert "probed" not in check.detail, check.detail


def test_a_regular_file_is_not_a_cache_directory(tmp_path):
    a_file = tmp_path / "ssd"
    a_file.write_text("")
    check = check_o_direct(str(a_file))
    assert check.status is Status.INVALID and f"{a_file} is a file, not a directory" in check.detail, check.detail
