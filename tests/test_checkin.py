"""The save's check-in (tierckpt.chain.checkin) on real gloo ranks: a rank slower by seconds still
saves; a live rank that never checks in is named by every other rank within the commit timeout and
the save fails on every rank with its own error; a retry under the same id saves; nothing is left on
the store. (A rank that dies in planning: tests/test_many_ranks.py.)"""

from __future__ import annotations

import pytest
from distrun import run_world

from tierckpt.chain.checkin import absent

WORLD = 4
SKIPPER = 2


@pytest.mark.timeout(300)
def test_check_in_waits_for_the_slow_names_the_missing_and_leaves_nothing(tmp_path):
    cfg = {"local": {"path": str(tmp_path / "ckpt" / "{node}")}, "job": {"commit_timeout": 6}}
    res = run_world(
        WORLD,
        "check_in_cases",
        {"config": cfg, "slow": 3, "skipper": SKIPPER},
        tmp_path / "w",
        node_of=lambda r: f"n{r // 2}",
        timeout=240,
    )
    for r, out in enumerate(res):
        assert out["left"] == [], (r, out)  # every save's check-in keys were deleted
        # DCP's gather carried the skipper's error to every rank (the others' check-in only logs:
        # it never fails a save by itself, a rank only late would still save)
        fails = out["failures"]
        assert sorted(fails) == [str(SKIPPER)], (r, out)
        assert f"planning broke on rank {SKIPPER}" in fails[str(SKIPPER)], (r, out)
        if r != SKIPPER:  # every other rank logged who was missing
            assert any(f"no report from rank {SKIPPER} within 6 s" in t for t in out["logged"]), (r, out)
    # the check-in's store operations (checks that found nothing included): the coordinator 5 (two
    # deletes, its id, one wait for every key, the verdict); every other rank 5 to 7, the verdict's
    # last reader 2 more
    ops = [sum(n for op, n in out["ops"].items() if op != "check_miss") for out in res]  # misses included
    assert ops[0] == 5 and res[0]["ops"]["wait"] == 1, res[0]["ops"]
    assert all(5 <= n <= 9 for n in ops[1:]) and sum(ops[1:]) <= 7 * (WORLD - 1) + 2, [out["ops"] for out in res]
    assert sum(out["ops"].get("delete_key", 0) for out in res) == 2 + (WORLD - 1) + 2, [out["ops"] for out in res]
    assert res[0]["slow_s"] >= 2, res[0]  # rank 0 waited for rank 1, 3 s late, and saved
    assert (tmp_path / "ckpt" / "n0" / "step-3" / "metadata.json").exists()
    assert (tmp_path / "ckpt" / "n1" / "step-2" / "metadata.json").exists()  # the retry under the same id


class _Store:
    """A store that answers ``check`` for a list of keys, counting the calls."""

    def __init__(self, keys: set[str]) -> None:
        self.keys, self.calls = keys, 0

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        return all(k in self.keys for k in keys)


def test_absent_bisects():
    keys = [f"k{i}" for i in range(1024)]
    s = _Store(set(keys) - {"k5", "k700"})
    assert absent(s, keys) == [5, 700]
    assert s.calls <= 2 * 2 * 10 + 1, s.calls  # O(m log n), not n
    s = _Store(set(keys))
    assert absent(s, keys) == [] and s.calls == 1
    assert absent(_Store(set()), keys[:3]) == [0, 1, 2]


def test_no_group_outside_dcp_save():
    """Called outside ``dcp.save`` (no DCP wrapper of a process group on the stack): no check-in."""
    from tierckpt.chain.checkin import dcp_group

    assert dcp_group() is None
