from distrun import run_world


def test_two_ranks_save_load(tmp_path):
    cfg = {"host": {"buffer_size": "8MiB", "chunk_size": "1MiB"}, "local": {"path": str(tmp_path / "ckpt")}}
    res = run_world(2, "save_and_load", {"config": cfg, "id": "step-1"}, tmp_path / "w")
    assert all(r["same"] for r in res)
