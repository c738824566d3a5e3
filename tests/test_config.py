from pathlib import Path

import pytest

from kvfs.config import ConfigError, build_config, parse_size, parse_tier_spec


@pytest.mark.parametrize("text,expected", [("512M", 512 << 20), ("8G", 8 << 30), ("1.5GiB", 3 << 29),
                                           ("4096", 4096), ("64k", 64 << 10), ("2T", 2 << 40)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "M", "12X", "-5G", "0"])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_tier_spec_splits_on_last_colon():
    assert parse_tier_spec("/dev/shm/a:b:2G") == (Path("/dev/shm/a:b"), 2 << 30)
    with pytest.raises(ConfigError):
        parse_tier_spec("/dev/shm/nosize")


def test_defaults_are_per_mountpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b = build_config(tmp_path / "a"), build_config(tmp_path / "b")
    assert a.l2.path != b.l2.path and a.state_dir != b.state_dir
    assert str(a.l2.path).startswith("/dev/shm/") and a.state_dir.is_relative_to(tmp_path / "cache")
    assert a.codec == "zstd" and a.l2.capacity == 1 << 30


def test_toml_then_command_line(tmp_path):
    cfg_file = tmp_path / "kvfs.toml"
    cfg_file.write_text('[mount]\ncodec = "none"\ndtype = "bf16"\n[l2]\npath = "/dev/shm/x"\ncapacity = "2G"\n')
    cfg = build_config(tmp_path / "m", config_file=cfg_file)
    assert (cfg.codec, cfg.dtype, cfg.l2.path, cfg.l2.capacity) == ("none", "bf16", Path("/dev/shm/x"), 2 << 30)
    cfg = build_config(tmp_path / "m", config_file=cfg_file, l2="/dev/shm/y:1G", codec="zstd")
    assert (cfg.codec, cfg.l2.path, cfg.l2.capacity) == ("zstd", Path("/dev/shm/y"), 1 << 30)


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[mount\n")
    with pytest.raises(ConfigError, match="bad TOML"):
        build_config(tmp_path / "m", config_file=bad)
    with pytest.raises(ConfigError, match="unknown codec"):
        build_config(tmp_path / "m", codec="lz4")
    other = tmp_path / "other.toml"
    other.write_text("[l9]\n")
    with pytest.raises(ConfigError, match="unknown config sections"):
        build_config(tmp_path / "m", config_file=other)
