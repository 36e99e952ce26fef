"""Hostile ``metadata.json`` bodies behind a *valid* checksum header (issue 10, item 4).

The checksum header only proves the body is what its writer wrote, not that the writer was
friendly. Whatever the body holds -- deep nesting, huge arrays, wrong types at every level,
non-objects where objects belong, NaN/huge numbers, duplicate keys, a string or a number --
``metadata_from_json`` and ``read_checkpoint_metadata`` either return the parsed metadata or
raise :class:`CorruptCheckpoint` naming the file, with a short message, and nothing else
(no ``RecursionError``, ``TypeError``, ``OverflowError``...). The restore CLI then prints one
line and exits 1 instead of "internal error".

The bodies are mutations of the metadata of a real checkpoint (saved with ``dcp.save`` through
``TieredWriter``), re-sealed with a correct length and CRC32C.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_restore_cli import assert_one_line_error, cli, cli_proc, write_config

from tierckpt import CheckpointNotFound, CorruptCheckpoint, HostConfig, LocalConfig, TierConfig, TieredWriter
from tierckpt.checksum import crc32c
from tierckpt.format import safejson
from tierckpt.format.layout import FORMAT, MAX_METADATA_BYTES, metadata_key
from tierckpt.format.metadata import metadata_from_json
from tierckpt.load.reader import read_checkpoint_metadata
from tierckpt.tiers.local import LocalTier

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

MiB = 1 << 20
WHERE = "file:///hostile/step-7/metadata.json"
CID = "step-7"
MAX_MESSAGE = 1000


# -- helpers ----------------------------------------------------------------------------------


def seal(body: bytes) -> bytes:
    """``body`` behind a header line whose format, length and CRC32C are all correct."""
    header = json.dumps({"format": FORMAT, "length": len(body), "crc32c": crc32c(body)}).encode()
    return header + b"\n" + body


def seal_doc(doc: Any) -> bytes:
    return seal(json.dumps(doc, separators=(",", ":"), allow_nan=True).encode())


def parse(raw: bytes) -> CorruptCheckpoint | None:
    """Parse ``raw``; return the CorruptCheckpoint it raised (None if it parsed). Any other
    exception fails the test. The message must name the file and stay short."""
    try:
        metadata_from_json(raw, WHERE)
    except CorruptCheckpoint as e:
        msg = str(e)
        assert msg.startswith(WHERE), msg[:300]
        assert len(msg) < MAX_MESSAGE, msg[:300]
        assert "\n" not in msg
        return e
    return None


def paths(x: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path (tuple of keys/indexes) to a value inside ``x``, the root included."""
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from paths(v, prefix + (i,))


def replaced(doc: Any, path: tuple, value: Any, *, delete: bool = False) -> Any:
    """A deep copy of ``doc`` with the value at ``path`` replaced (or deleted)."""
    doc = json.loads(json.dumps(doc))
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def nested(depth: int) -> Any:
    x: Any = 0
    for _ in range(depth):
        x = [x]
    return x


REPLACEMENTS: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    2**64 + 1,
    10**39,
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "float32",
    "bytes",
    "tensor",
    "rank-00000.data",
    "../../etc/passwd",
    "latest",
    "a" * 5000,
    [],
    [None],
    [[[]]],
    [0, 0, 0],
    ["a", 1, None],
    {},
    {"a": 1},
    {"__tuple__": [1]},
    {"__dict__": {}},
    {"type": "tensor"},
    nested(150),
    [0] * 5000,
]


# -- a real checkpoint ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> tuple[bytes, dict]:
    """``(metadata.json bytes, its body as a dict)`` of a real checkpoint with tensors of several
    dtypes and shapes, an empty and a 0-dim tensor, and non-tensor items."""
    root = tmp_path_factory.mktemp("hostile") / "ckpt"
    cfg = TierConfig(
        host=HostConfig(buffer_size=2 * MiB, chunk_size=256 << 10),
        local=LocalConfig(path=str(root), keep=0, fsync=False),
    )
    g = torch.Generator().manual_seed(0)
    sd = {
        "model": {
            "w": torch.randn(40, 30, generator=g),
            "b": torch.randn(30, generator=g).bfloat16(),
            "scale": torch.tensor(2.0),
            "empty": torch.empty(0, 3),
        },
        "optim": {"lr": 0.1, "betas": (0.9, 0.99)},
        "step": 7,
        "name": "run",
    }
    w = TieredWriter(cfg)
    dcp.save(sd, checkpoint_id=CID, storage_writer=w, no_dist=True)
    w.wait()
    raw = LocalTier(root).get(metadata_key(CID))
    return raw, json.loads(raw.partition(b"\n")[2])


def test_real_metadata_parses(real):
    raw, doc = real
    assert parse(raw) is None
    assert parse(seal_doc(doc)) is None  # re-sealing is faithful


def test_the_same_metadata_bytes_parse_once_and_nothing_else_is_reused(real):
    """``parse_checkpoint_doc`` reuses the parse of the very same bytes (a resume reads one
    checkpoint's metadata for its health check, then for the load); other bytes are parsed
    (and refused) as ever, a cached document naming another checkpoint is still refused, and
    bytes that failed are never kept."""
    from tierckpt.catalog.listing import parse_checkpoint_doc

    raw, doc = real
    first = parse_checkpoint_doc(raw, WHERE, CID)
    assert parse_checkpoint_doc(bytearray(raw), WHERE, CID) is first  # the same bytes: the same document
    with pytest.raises(CorruptCheckpoint, match="names checkpoint"):
        parse_checkpoint_doc(raw, WHERE, "step-8")
    other = seal_doc(doc | {"step": 8})
    assert parse_checkpoint_doc(other, WHERE, CID) is not first
    flipped = raw[:-2] + bytes([raw[-2] ^ 1]) + raw[-1:]  # one body byte off: its CRC32C fails
    for _ in range(2):
        with pytest.raises(CorruptCheckpoint, match="CRC32C"):
            parse_checkpoint_doc(flipped, WHERE, CID)


# -- item 4: the reported case and its relatives ----------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 200_000,
        b"{" * 200_000,
        b'{"a":' * 100_000,
        b"[{" * 100_000,
        b'["]]]]",' * 1000 + b"[" * 300,  # brackets in strings do not hide real nesting
        b'["\\\\",' + b"[" * 300,  # nor do escaped backslashes
        b'"\\"[[[' + b"[" * 300 + b'"',  # a string full of brackets is fine (not nesting)
    ],
    ids=["arrays", "objects-unterminated", "object-chain", "mixed", "strings-with-brackets", "escapes", "string"],
)
def test_deep_nesting_is_corrupt(body):
    e = parse(seal(body))
    assert e is not None


def test_deep_nesting_with_a_high_recursion_limit_does_not_crash(tmp_path):
    """With ``sys.setrecursionlimit(10**6)`` the stdlib decoder would recurse 200k levels deep
    in C and overflow the stack (CPython 3.11); the nesting is refused before decoding."""
    code = (
        "import sys, json\n"
        "from tierckpt.checksum import crc32c\n"
        "from tierckpt.format.layout import FORMAT\n"
        "from tierckpt.format.metadata import metadata_from_json\n"
        "from tierckpt.errors import CorruptCheckpoint\n"
        "sys.setrecursionlimit(10**6)\n"
        "body = b'[' * 2_000_000\n"
        "raw = json.dumps({'format': FORMAT, 'length': len(body), 'crc32c': crc32c(body)}).encode() + b'\\n' + body\n"
        "try:\n"
        "    metadata_from_json(raw, 'X')\n"
        "except CorruptCheckpoint as e:\n"
        "    print('corrupt:', e)\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=str(Path(__file__).resolve().parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.startswith("corrupt: X: ") and "nested deeper" in p.stdout


@pytest.mark.parametrize(
    "body",
    [
        b'"a string"',
        b"42",
        b"-1",
        b"1e999",
        b"null",
        b"true",
        b"[]",
        b"{}",
        b"NaN",
        b"Infinity",
        b"-Infinity",
        b"[NaN]",
        b"[1e999]",
        b"[-1e999]",
        b"1" * 100_000,
        b'{"format":"tierckpt/1","format":"tierckpt/1"}',
        b'{"a":{"b":1,"b":2}}',
        b"",
        b" ",
        b"\xff\xfe[\x00]\x00",
        b"\xef\xbb\xbf{}",
        b'{"a":"\xff"}',
        b"[1,2",
        b"{}garbage",
        b'{"a":"\x01"}',
        b'["\\ud800"]',
        b'["\\x"]',
        b"[" + b"0," * 500_000 + b"0]",
    ],
    ids=lambda b: repr(b[:24]),
)
def test_wrong_shapes_are_corrupt(body):
    assert parse(seal(body)) is not None


def test_non_finite_and_huge_numbers_in_fields(real):
    _raw, doc = real
    for key in ("created", "committed", "chunk_size", "world_size", "step"):
        for bad in (float("nan"), float("inf"), -float("inf"), 10**400, 2**63, -1, "1", True, None, [1]):
            if key == "step" and bad is None:
                continue  # a checkpoint without a step is legal
            assert parse(seal_doc(replaced(doc, (key,), bad))) is not None, (key, bad)


def test_duplicate_keys_at_every_level(real):
    _raw, doc = real
    body = json.dumps(doc, separators=(",", ":"))
    # duplicate the first key of the document, and of the first item
    dup_top = body.replace('{"format":"tierckpt/1",', '{"format":"tierckpt/1","format":"tierckpt/1",', 1)
    assert parse(seal(dup_top.encode())) is not None
    dup_item = body.replace('"items":[{', '"items":[{"pos":0,', 1)
    assert dup_item != body and parse(seal(dup_item.encode())) is not None


def test_every_field_with_every_wrong_type(real):
    """Replace (or delete) the value at every path of a real document with values of every
    JSON type: the parser returns or raises CorruptCheckpoint, never anything else."""
    _raw, doc = real
    all_paths = list(paths(doc))
    rng = random.Random(10)
    chosen = all_paths if len(all_paths) <= 160 else [()] + rng.sample(all_paths[1:], 159)
    refused = 0
    for path in chosen:
        for value in REPLACEMENTS:
            refused += parse(seal_doc(replaced(doc, path, value))) is not None
        if path and isinstance(path[-1], str):
            refused += parse(seal_doc(replaced(doc, path, None, delete=True))) is not None
    assert refused > len(chosen)  # most changes are refused; none escapes as another exception


def test_random_byte_mutations(real):
    """Flip, insert, delete and duplicate bytes of a real body, then re-seal it."""
    raw, _doc = real
    body = raw.partition(b"\n")[2]
    rng = random.Random(4)
    specials = b'[]{}",:\\0123456789-eE.ntfaNI\x00\xff'
    for _ in range(600):
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(4)
            i = rng.randrange(len(b))
            if op == 0:
                b[i] = rng.choice(specials)
            elif op == 1:
                b[i:i] = bytes([rng.choice(specials)]) * rng.randint(1, 300)
            elif op == 2:
                del b[i : i + rng.randint(1, 40)]
            else:
                j = rng.randrange(len(b))
                b[i:i] = b[j : j + rng.randint(1, 200)]
        parse(seal(bytes(b)))


def test_huge_arrays_and_strings_where_small_ones_belong(real):
    """Large values in the wrong places are refused by type or size checks, quoting only a few
    characters of them."""
    _raw, doc = real
    big = {
        ("checkpoint_id",): "x" * 1_000_000,
        ("save_token",): "f" * 1_000_000,
        ("files",): {f"rank-{i:05d}.data": 64 for i in range(50_000)} | {"bad name": 1},
        ("items",): [{}] * 200_000,
        ("dcp", "state_dict_metadata"): {f"k{i}": {"type": "nope"} for i in range(50_000)},
        ("dcp", "planner_data"): nested(100),
        ("dcp", "storage_meta"): {"checkpoint_id": None, "modules": list(range(100_000))},
        ("dcp", "version"): ["1.0.0"] * 100_000,
    }
    for path, value in big.items():
        e = parse(seal_doc(replaced(doc, path, value)))
        assert e is not None, path


def test_items_with_absurd_ranges_are_refused_without_iterating_them(real):
    """An item covering 2**61 bytes with a 4 KiB chunk size would mean 2**49 checksum pieces:
    the count is computed, never enumerated."""
    _raw, doc = real
    doc2 = json.loads(json.dumps(doc))
    doc2["chunk_size"] = 4096
    name = next(iter(doc2["files"]))
    doc2["files"][name] = 1 << 62
    item = next(it for it in doc2["items"] if it["file"] == name)
    item["pos"], item["length"], item["dtype"], item["shape"] = 0, 1 << 61, "", []
    e = parse(seal_doc(doc2))
    assert e is not None and "checksums" in str(e)


# -- the bound on nesting itself --------------------------------------------------------------


def _depth(x: Any) -> int:
    if isinstance(x, list):
        return 1 + max((_depth(v) for v in x), default=0)
    if isinstance(x, dict):
        return 1 + max((_depth(v) for v in x.values()), default=0)
    return 0


def _random_json(rng: random.Random, depth: int) -> Any:
    tricky = ['"', "\\", "[", "]", "{", "}", '\\"', "\\\\", '""', "\\[", "a", "é", "\u2028"]
    if depth == 0 or rng.random() < 0.25:
        return (
            "".join(rng.choice(tricky) for _ in range(rng.randint(0, 8))) if rng.random() < 0.6 else rng.randint(-9, 9)
        )
    if rng.random() < 0.5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {
        "".join(rng.choice(tricky) for _ in range(rng.randint(0, 4))) + str(i): _random_json(rng, depth - 1)
        for i in range(rng.randint(0, 3))
    }


def test_too_deep_matches_the_real_depth():
    rng = random.Random(7)
    for _ in range(400):
        doc = _random_json(rng, rng.randint(0, 12))
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
        d = _depth(doc)
        assert not safejson.too_deep(text, d), text
        if d:
            # the fast path (few brackets) answers False only when the count itself is small
            assert safejson.too_deep(text, d - 1), text


def test_safejson_accepts_what_the_writer_writes():
    doc = {"a": [1, -2, 3.5, -0.0, 1e-300, 2**62, 'x\\"[]{}', None, True, False], "b": {"c": {"d": []}}}
    assert safejson.loads(json.dumps(doc).encode()) == doc


# -- through the reader and the CLI -----------------------------------------------------------

HOSTILE_BODIES = {
    "deep": b"[" * 200_000,
    "string": b'"just a string"',
    "number": b"1e999",
    "dup": b'{"format":"tierckpt/1","checkpoint_id":"step-7","checkpoint_id":"step-7"}',
}


@pytest.fixture
def hostile_tier(tmp_path) -> tuple[Path, LocalTier]:
    root = tmp_path / "local"
    return root, LocalTier(root, fsync=False)


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
def test_read_checkpoint_metadata_raises_corrupt(hostile_tier, name):
    root, tier = hostile_tier
    tier.put(metadata_key(CID), seal(HOSTILE_BODIES[name]))
    with pytest.raises(CorruptCheckpoint) as ei:
        read_checkpoint_metadata(tier, CID)
    assert f"{CID}/metadata.json" in str(ei.value)
    with pytest.raises(CheckpointNotFound):
        read_checkpoint_metadata(tier, "step-8")


def test_oversized_metadata_is_refused_before_reading(hostile_tier):
    root, tier = hostile_tier
    tier.put(metadata_key(CID), b"{}")
    path = next(root.rglob("metadata.json"))
    with open(path, "r+b") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: no disk space, and never read
    with pytest.raises(CorruptCheckpoint, match="larger than"):
        read_checkpoint_metadata(tier, CID)


def test_cli_reports_hostile_metadata_in_one_line(tmp_path):
    """The issue's repro: a checkpoint whose metadata is 200k ``[`` behind a valid header made
    the CLI say "internal error"; now ``verify`` names the file in its report and fails in one
    line, ``consolidate`` says "corrupt checkpoint" naming the file, and ``latest`` (which skips
    or reports such a checkpoint) never shows an internal error. Exit status 1 throughout."""
    root = tmp_path / "local"
    cfg = write_config(tmp_path / "tiers.toml", local=root)
    for name, body in HOSTILE_BODIES.items():
        LocalTier(root, fsync=False).put(metadata_key(CID), seal(body))
        run = cli_proc if name == "deep" else cli  # the case as a person runs it, the rest in-process
        p = run("verify", CID, config=cfg)
        assert_one_line_error(p, 1, "failed verification", CID)
        assert f"BAD local: metadata.json: {root}/{CID}/metadata.json" in p.stdout, p.stdout
        line = assert_one_line_error(
            cli("consolidate", CID, "--out", str(tmp_path / "x.pt"), config=cfg),
            1,
            "corrupt checkpoint",
            f"{CID}/metadata.json",
        )
        p = cli("latest", config=cfg)
        assert p.returncode == 1 and "internal error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert "internal error" not in line
