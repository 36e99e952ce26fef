"""Configuration: TOML loading, ``TIERCKPT_CONFIG``, size parsing, and one-line ConfigErrors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierckpt import ConfigError, HostConfig, LocalConfig, S3Config, TierckptError, TierConfig, load_config, parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def write(tmp_path: Path, text: str, name: str = "tierckpt.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def config_error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    err = ei.value
    assert isinstance(err, TierckptError) and isinstance(err, ValueError)
    assert "\n" not in str(err), repr(str(err))
    assert str(path) in str(err), str(err)
    return err


LOCAL = '[local]\npath = "/tmp/tierckpt-test"\n'


# -- good files ---------------------------------------------------------------------------


def test_full_file(tmp_path):
    p = write(
        tmp_path,
        f"""
[job]
commit_timeout = 30
log_level = "info"

[host]
buffer_size = "512MiB"
chunk_size = "8MiB"
pinned = false

[local]
path = "{tmp_path}/ckpt"
flush_threads = 2
keep = 2
fsync = false

[s3]
bucket = "ckpts"
prefix = "runs/a"
endpoint_url = "http://127.0.0.1:9000"
part_size = "64MB"
concurrency = 4
keep = 7
keep_every = 1000
connect_timeout = 3
read_timeout = 4.5
conditional_commit = false
""",
    )
    cfg = load_config(p)
    assert isinstance(cfg, TierConfig)
    assert cfg.source == str(p)
    assert cfg.host.buffer_size == 512 * MiB and cfg.host.chunk_size == 8 * MiB and cfg.host.pinned is False
    assert cfg.local is not None and cfg.local.path == f"{tmp_path}/ckpt"
    assert cfg.local.flush_threads == 2 and cfg.local.keep == 2 and cfg.local.fsync is False
    assert cfg.s3 is not None and cfg.s3.bucket == "ckpts" and cfg.s3.prefix == "runs/a"
    assert cfg.s3.part_size == 64_000_000 and cfg.s3.concurrency == 4 and cfg.s3.keep == 7 and cfg.s3.keep_every == 1000
    assert cfg.s3.connect_timeout == 3.0 and isinstance(cfg.s3.connect_timeout, float) and cfg.s3.read_timeout == 4.5
    assert cfg.s3.conditional_commit is False
    assert cfg.job.commit_timeout == 30.0 and cfg.job.log_level == "info"


def test_minimal_files_and_defaults(tmp_path):
    cfg = load_config(write(tmp_path, LOCAL))
    assert cfg.s3 is None and cfg.local.path == "/tmp/tierckpt-test"
    assert cfg.host == HostConfig() and cfg.local.flush_threads == 4 and cfg.local.keep == 3 and cfg.local.fsync is True
    cfg = load_config(write(tmp_path, '[s3]\nbucket = "b"\n', "s3.toml"))
    assert cfg.local is None and cfg.s3.bucket == "b" and cfg.s3.part_size == 64 * MiB


@pytest.mark.parametrize(
    "text, expected",
    [
        ('"512MiB"', 512 * MiB),
        ('"8GiB"', 8 * GiB),
        ('"64MB"', 64_000_000),
        ("1048576", 1048576),
        ('"1048576"', 1048576),
        ('"4 MiB"', 4 * MiB),
        ('"256kib"', 256 * KiB),
        ('"1.5GiB"', 3 * GiB // 2),
        ('"3m"', 3_000_000),
        ('"65536b"', 65536),
    ],
)
def test_sizes_from_toml(tmp_path, text, expected):
    cfg = load_config(write(tmp_path, f'[host]\nbuffer_size = "64GiB"\nchunk_size = {text}\n' + LOCAL))
    assert cfg.host.chunk_size == expected and cfg.host.buffer_size == 64 * GiB
    cfg = (
        load_config(write(tmp_path, f'[s3]\nbucket = "b"\npart_size = {text}\n', "s3.toml"))
        if 5 * MiB <= expected <= 5 * GiB
        else None
    )
    assert cfg is None or cfg.s3.part_size == expected


@pytest.mark.parametrize(
    "value, expected",
    [
        ("512MiB", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("64MB", 64_000_000),
        (1048576, 1048576),
        ("2TiB", 2 << 40),
        ("10KB", 10_000),
        ("0", 0),
        (0, 0),
    ],
)
def test_parse_size(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value", ["-1", "-1MiB", -5, "lots", "12 parsecs", "", "MiB", "1.2.3GiB", True, 1.5, None, [1]]
)
def test_parse_size_rejects(value):
    with pytest.raises(ConfigError) as ei:
        parse_size(value, "[host] buffer_size")
    assert "[host] buffer_size" in str(ei.value) and "\n" not in str(ei.value)


def test_config_from_environment(tmp_path, monkeypatch):
    p = write(tmp_path, '[local]\npath = "/tmp/from-env"\nkeep = 9\n')
    monkeypatch.setenv("TIERCKPT_CONFIG", str(p))
    cfg = load_config()
    assert cfg.local.path == "/tmp/from-env" and cfg.local.keep == 9 and cfg.source == str(p)


def test_environment_unset(monkeypatch):
    monkeypatch.delenv("TIERCKPT_CONFIG", raising=False)
    with pytest.raises(ConfigError) as ei:
        load_config()
    assert "TIERCKPT_CONFIG" in str(ei.value) and "\n" not in str(ei.value)


def test_environment_names_missing_file(tmp_path, monkeypatch):
    missing = tmp_path / "nope.toml"
    monkeypatch.setenv("TIERCKPT_CONFIG", str(missing))
    with pytest.raises(ConfigError) as ei:
        load_config()
    assert str(missing) in str(ei.value) and "\n" not in str(ei.value)


def test_writer_and_reader_accept_a_path(tmp_path, monkeypatch):
    from tierckpt import TieredReader, TieredWriter

    p = write(
        tmp_path, f'[host]\nbuffer_size = "4MiB"\nchunk_size = "1MiB"\n[local]\npath = "{tmp_path}/c"\nfsync = false\n'
    )
    assert TieredWriter(str(p)).cfg.local.path == f"{tmp_path}/c"
    monkeypatch.setenv("TIERCKPT_CONFIG", str(p))
    assert TieredReader().cfg.host.buffer_size == 4 * MiB


def test_node_placeholder(tmp_path, monkeypatch):
    p = write(tmp_path, f'[local]\npath = "{tmp_path}/{{node}}/ckpt"\n')
    monkeypatch.setenv("TIERCKPT_NODE", "node7")
    cfg = load_config(p)
    assert cfg.local.path.endswith("/{node}/ckpt")  # stored verbatim, filled at use
    assert cfg.local.resolved_path() == tmp_path / "node7" / "ckpt"
    monkeypatch.setenv("TIERCKPT_NODE", "node3")
    assert cfg.local.resolved_path() == tmp_path / "node3" / "ckpt"


def test_node_placeholder_fallbacks(tmp_path, monkeypatch):
    import socket

    cfg = LocalConfig(path=str(tmp_path / "{node}"))
    for var in ("TIERCKPT_NODE", "GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NODE_RANK", "5")
    assert cfg.resolved_path() == tmp_path / "5"
    monkeypatch.setenv("GROUP_RANK", "2")
    assert cfg.resolved_path() == tmp_path / "2"
    monkeypatch.setenv("TIERCKPT_NODE", "n")
    assert cfg.resolved_path() == tmp_path / "n"
    for var in ("TIERCKPT_NODE", "GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(var)
    assert cfg.resolved_path() == tmp_path / socket.gethostname()
    assert LocalConfig(path=str(tmp_path / "{hostname}")).resolved_path() == tmp_path / socket.gethostname()


def test_effective_chunk_size():
    assert HostConfig(buffer_size=8 * MiB, chunk_size=1 * MiB).effective_chunk_size == 1 * MiB
    assert HostConfig(buffer_size=8 * MiB, chunk_size=32 * MiB).effective_chunk_size == 2 * MiB  # a quarter of the pool
    assert HostConfig(buffer_size=8 * MiB, chunk_size=100_000).effective_chunk_size % 4096 == 0


# -- errors: one line, naming file, section and key ---------------------------------------

KEY_ERRORS = [
    # unknown key
    (LOCAL + "flush_thread = 3\n", "[local]", "flush_thread", ["unknown key"]),
    ("[host]\nbufer_size = 1\n" + LOCAL, "[host]", "bufer_size", ["unknown key"]),
    # wrong types
    ('[local]\npath = "/x"\nflush_threads = "4"\n', "[local]", "flush_threads", ["integer"]),
    ('[local]\npath = "/x"\nkeep = 2.5\n', "[local]", "keep", ["integer"]),
    ('[local]\npath = "/x"\nfsync = 1\n', "[local]", "fsync", ["true or false"]),
    ('[host]\npinned = "yes"\n' + LOCAL, "[host]", "pinned", ["true or false"]),
    ('[local]\npath = "/x"\nflush_threads = true\n', "[local]", "flush_threads", ["integer"]),
    ("[host]\nbuffer_size = true\n" + LOCAL, "[host]", "buffer_size", ["boolean"]),
    ("[host]\nchunk_size = 1.5\n" + LOCAL, "[host]", "chunk_size", []),
    ("[local]\npath = 17\n", "[local]", "path", ["string"]),
    ('[s3]\nbucket = "b"\nread_timeout = "slow"\n', "[s3]", "read_timeout", ["number"]),
    ("[job]\ncommit_timeout = false\n" + LOCAL, "[job]", "commit_timeout", ["number"]),
    # negative / unparseable sizes
    ("[host]\nbuffer_size = -1\n" + LOCAL, "[host]", "buffer_size", ["negative"]),
    ('[host]\nbuffer_size = "-8MiB"\n' + LOCAL, "[host]", "buffer_size", ["negative"]),
    ('[host]\nchunk_size = "lots"\n' + LOCAL, "[host]", "chunk_size", ["parse"]),
    ('[s3]\nbucket = "b"\npart_size = "64 potatoes"\n', "[s3]", "part_size", ["parse"]),
    # missing required keys
    ("[local]\nkeep = 1\n", "[local]", "path", ["missing"]),
    ('[s3]\nprefix = "p"\n', "[s3]", "bucket", ["missing"]),
    ('[local]\npath = ""\n', "[local]", "path", ["required"]),
    # out of range
    ('[local]\npath = "/x"\nflush_threads = 0\n', "[local]", "flush_threads", ["between"]),
    ('[local]\npath = "/x"\nflush_threads = 65\n', "[local]", "flush_threads", ["between"]),
    ('[local]\npath = "/x"\nkeep = -1\n', "[local]", "keep", ["negative"]),
    ('[s3]\nbucket = "b"\npart_size = "1MiB"\n', "[s3]", "part_size", ["5MiB"]),
    ('[s3]\nbucket = "b"\npart_size = "6GiB"\n', "[s3]", "part_size", ["5GiB"]),
    ('[s3]\nbucket = "b"\nconcurrency = 0\n', "[s3]", "concurrency", ["between"]),
    ('[s3]\nbucket = "b"\nmax_attempts = 0\n', "[s3]", "max_attempts", []),
    ('[s3]\nbucket = "b"\nprefix = "../up"\n', "[s3]", "prefix", [".."]),
    ('[host]\nbuffer_size = "1MiB"\n' + LOCAL, "[host]", "buffer_size", ["2MiB"]),
    ("[host]\nchunk_size = 1024\n" + LOCAL, "[host]", "chunk_size", ["64KiB"]),
    ("[job]\ncommit_timeout = 0\n" + LOCAL, "[job]", "commit_timeout", ["positive"]),
    ('[job]\nlog_level = "LOUD"\n' + LOCAL, "[job]", "log_level", []),
]


@pytest.mark.parametrize(
    "text, section, key, words", KEY_ERRORS, ids=[f"{s}{k}-{i}" for i, (_t, s, k, _w) in enumerate(KEY_ERRORS)]
)
def test_key_errors(tmp_path, text, section, key, words):
    err = config_error(write(tmp_path, text))
    msg = str(err)
    assert section in msg and key in msg, msg
    for w in words:
        assert w.lower() in msg.lower(), msg


@pytest.mark.parametrize(
    "text, section",
    [
        ("[hots]\nbuffer_size = 1\n" + LOCAL, "[hots]"),
        (LOCAL + '[S3]\nbucket = "b"\n', "[S3]"),
        (LOCAL + "[local.extra]\nx = 1\n", "[local]"),  # a sub-table is an unknown key of [local]
    ],
)
def test_unknown_section(tmp_path, text, section):
    err = config_error(write(tmp_path, text))
    assert section in str(err)


def test_section_that_is_not_a_table(tmp_path):
    err = config_error(write(tmp_path, "local = 3\n"))
    assert "[local]" in str(err)
    err = config_error(write(tmp_path, '[[local]]\npath = "/x"\n', "arr.toml"))
    assert "[local]" in str(err)


def test_neither_local_nor_s3(tmp_path):
    err = config_error(write(tmp_path, '[host]\nbuffer_size = "8MiB"\n'))
    assert "[local]" in str(err) and "[s3]" in str(err)
    err = config_error(write(tmp_path, "", "empty.toml"))
    assert "[local]" in str(err) and "[s3]" in str(err)


@pytest.mark.parametrize(
    "text",
    [
        '[local\npath = "/x"\n',
        "[local]\npath = /x\n",
        '[local]\npath = "/x"\npath = "/y"\n',
        '[local]\npath = "unterminated\n',
        '[local]\npath = "/x"\n[local]\nkeep = 1\n',
    ],
)
def test_invalid_toml(tmp_path, text):
    err = config_error(write(tmp_path, text))
    assert "TOML" in str(err)


def test_not_utf8(tmp_path):
    p = tmp_path / "latin1.toml"
    p.write_bytes('[local]\npath = "/tmp/caf\xe9"\n'.encode("latin-1"))
    config_error(p)


def test_missing_file(tmp_path):
    err = config_error(tmp_path / "does-not-exist.toml")
    assert "does-not-exist.toml" in str(err)


def test_directory_instead_of_file(tmp_path):
    d = tmp_path / "adir.toml"
    d.mkdir()
    config_error(d)


def test_quoted_key_with_newline_stays_one_line(tmp_path):
    """Even a hostile key name (a quoted TOML key holding a newline) must not break the one-line rule."""
    err = config_error(write(tmp_path, '[local]\npath = "/x"\n"flush\\nthreads" = 3\n'))
    assert "[local]" in str(err)


def test_quoted_section_with_newline_stays_one_line(tmp_path):
    config_error(write(tmp_path, '["lo\\ncal"]\npath = "/x"\n'))


# -- the same validation in Python ---------------------------------------------------------


def test_python_config_validation():
    with pytest.raises(ConfigError):
        TierConfig()
    with pytest.raises(ConfigError) as ei:
        TierConfig(local=LocalConfig(path="/x", flush_threads=0))
    assert "[local] flush_threads" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        TierConfig(local=LocalConfig(path="/x"), s3=S3Config(bucket="b", part_size=1 * MiB))
    assert "[s3] part_size" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        TierConfig(s3=S3Config())
    assert "[s3] bucket" in str(ei.value)


def test_python_config_accepts_size_strings(tmp_path):
    cfg = TierConfig(
        host=HostConfig(buffer_size="8MiB", chunk_size="1MiB"),
        local=LocalConfig(path=str(tmp_path)),
        s3=S3Config(bucket="b", part_size="64MiB"),
    )
    assert cfg.host.buffer_size == 8 * MiB and cfg.host.chunk_size == 1 * MiB and cfg.s3.part_size == 64 * MiB


def test_python_config_wrong_type_is_config_error(tmp_path):
    with pytest.raises(ConfigError):
        TierConfig(local=LocalConfig(path=str(tmp_path), flush_threads="4"))


def test_environment_does_not_leak(tmp_path):
    # load_config(path) ignores TIERCKPT_CONFIG when a path is given
    p = write(tmp_path, LOCAL)
    old = os.environ.get("TIERCKPT_CONFIG")
    os.environ["TIERCKPT_CONFIG"] = str(tmp_path / "other.toml")
    try:
        assert load_config(p).local.path == "/tmp/tierckpt-test"
    finally:
        if old is None:
            del os.environ["TIERCKPT_CONFIG"]
        else:
            os.environ["TIERCKPT_CONFIG"] = old


# -- [export] -----------------------------------------------------------------------------


def test_export_section(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            LOCAL + '[export]\nevery = 5\npath = "/exports/{checkpoint_id}"\nkeys = ["model."]\n'
            'strip_prefix = "model."\ndtype = "bfloat16"\nfiles = "config.json"\n'
            'adapter = "torchtitan.models.llama3:to_hf"\nmax_shard_size = "5GB"\n',
        )
    )
    ex = cfg.export
    assert (ex.every, ex.path, ex.keys, ex.files, ex.dtype) == (
        5,
        "/exports/{checkpoint_id}",
        ["model."],
        ["config.json"],
        "bfloat16",
    )
    assert load_config(write(tmp_path, LOCAL, "plain.toml")).export.every == 0  # off unless asked


@pytest.mark.parametrize(
    "body, needle",
    [
        ("every = 2", "[export] path: required when every is set"),
        ('every = -1\npath = "/x"', "[export] every"),
        ('format = "gguf"', "[export] format"),
        ('dtype = "int8"', "[export] dtype"),
        ('max_shard_size = "5GiB"', "[export] max_shard_size"),
        ('max_shard_size = "lots"', "[export] max_shard_size"),
        ("keys = [1, 2]", "[export] keys: expected a list of strings"),
        ('adapter = "not a path"', "[export] adapter"),
        ("nosuch = 1", "[export] nosuch: unknown key"),
    ],
)
def test_export_section_errors(tmp_path, body, needle):
    err = config_error(write(tmp_path, LOCAL + "[export]\n" + body + "\n"))
    assert needle in str(err), str(err)
