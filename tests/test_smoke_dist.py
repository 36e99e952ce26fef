from distrun import run_world


def test_two_ranks_save_load(tmp_path):
    cfg = {"host": {"buffer_size": "8MiB", "chunk_size": "1MiB"}, "local": {"path": str(tmp_path / "ckpt")}}
    res = run_world(2, "save_and_load", {"config": cfg, "id": "step-1"}, tmp_path / "w")
    assert all(r["same"] for r in res)


def test_hidden_directories_are_unseen_by_forked_and_execd_ranks(tmp_path, monkeypatch):
    """``hide_of``: each simulated node's rank sees its own directory and an empty one where the
    other node's disk is (a forked rank hides it itself; an exec'd one through ``unshare``)."""
    import pytest

    from tierckpt.testing import can_hide_paths

    if not can_hide_paths():
        pytest.skip("needs root and mount namespaces (unshare)")
    dirs = [tmp_path / "n0", tmp_path / "n1"]
    for i, d in enumerate(dirs):
        d.mkdir()
        (d / f"file{i}").write_text("x")
    args = {"dirs": [str(d) for d in dirs]}
    for launch in ("fork", "exec"):
        monkeypatch.setenv("TIERCKPT_LAUNCH", launch)
        res = run_world(2, "visible", args, tmp_path / launch, hide_of=lambda r: [str(dirs[1 - r])])
        assert res[0]["seen"] == {str(dirs[0]): ["file0"], str(dirs[1]): []}, (launch, res)
        assert res[1]["seen"] == {str(dirs[0]): [], str(dirs[1]): ["file1"]}, (launch, res)
    assert sorted(p.name for p in dirs[1].iterdir()) == ["file1"]  # the parent still sees both
