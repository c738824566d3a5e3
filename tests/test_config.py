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
    assert a.codec == "auto" and a.l2.capacity == 1 << 30


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


def test_l3_defaults_toml_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = build_config(tmp_path / "m")
    assert cfg.l3.path == cfg.state_dir / "l3" and cfg.l3.capacity == 16 << 30 and cfg.l3.persistent
    assert [t.name for t in cfg.tiers] == ["L2", "L3"] and not cfg.l2.persistent
    assert (cfg.l2.high_watermark, cfg.l2.low_watermark) == (0.9, 0.8) and str(cfg.promotion) == "always"
    toml = tmp_path / "t.toml"
    toml.write_text('[mount]\npromote = 2\n[l2]\nhigh_watermark = 0.75\nlow_watermark = 0.5\n'
                    '[l3]\npath = "/var/tmp/x"\ncapacity = "100G"\nhigh_watermark = 0.99\nlow_watermark = 0.95\n')
    cfg = build_config(tmp_path / "m", config_file=toml)
    assert (cfg.l2.high_watermark, cfg.l2.low_watermark) == (0.75, 0.5)
    assert (cfg.l3.path, cfg.l3.capacity, cfg.l3.high_watermark) == (Path("/var/tmp/x"), 100 << 30, 0.99)
    assert cfg.promotion.after_reads == 2 and str(cfg.promotion) == "after 2 reads"
    cfg = build_config(tmp_path / "m", config_file=toml, l3="/ssd/kv:2T", promote="never")
    assert (cfg.l3.path, cfg.l3.capacity, cfg.l3.low_watermark) == (Path("/ssd/kv"), 2 << 40, 0.95)
    assert cfg.promotion.after_reads == 0
    no_l3 = build_config(tmp_path / "m", l3="none")
    assert no_l3.l3 is None and [t.name for t in no_l3.tiers] == ["L2"]


@pytest.mark.parametrize("toml,message", [
    ('[l2]\nhigh_watermark = 0.5\nlow_watermark = 0.7\n', "watermarks"),
    ('[l3]\nhigh_watermark = 1.5\n', "watermarks"),
    ('[l3]\nsize = "1G"\n', "unknown keys in \\[l3\\]"),
    ('[mount]\npromote = "sometimes"\n', "promotion policy"),
    ('[mount]\npromote = 0\n', "makes no sense"),
])
def test_bad_tier_settings_are_clear_errors(tmp_path, toml, message):
    f = tmp_path / "t.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        build_config(tmp_path / "m", config_file=f)


def test_l2_and_l3_must_differ(tmp_path):
    with pytest.raises(ConfigError, match="different"):
        build_config(tmp_path / "m", l2=f"{tmp_path}/same:1G", l3=f"{tmp_path}/same:2G")


@pytest.mark.parametrize("text,seconds", [("10m", 600), ("90s", 90), ("2h", 7200), ("45", 45), ("off", 0),
                                          ("never", 0), ("0", 0), (30, 30)])
def test_idle_period(text, seconds, tmp_path):
    assert build_config(tmp_path / "m", idle=text).idle_s == seconds


@pytest.mark.parametrize("bad", ["soon", "0.5", "-3m", "10 minutes"])
def test_idle_period_rejects(bad, tmp_path):
    with pytest.raises(ConfigError):
        build_config(tmp_path / "m", idle=bad)


def test_idle_from_toml_and_the_command_line_wins(tmp_path):
    toml = tmp_path / "k.toml"
    toml.write_text('[mount]\nidle = "5m"\n')
    assert build_config(tmp_path / "m", config_file=toml).idle_s == 300
    assert build_config(tmp_path / "m", config_file=toml, idle="off").idle_s == 0
    assert build_config(tmp_path / "m").idle_s == 0


def test_max_dirty_follows_a_container_memory_limit(tmp_path, monkeypatch):
    """In a container (a pod with a memory limit) the default is a quarter of the limit, not of the host's RAM."""
    import os

    from kvfs import config

    limit_file = tmp_path / "memory.max"
    monkeypatch.setattr(config, "CGROUP_MEMORY_LIMITS", (str(limit_file),))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert config.memory_limit() is None and config.default_max_dirty() == max(256 << 20, ram // 4)
    limit_file.write_text("max\n")  # cgroup v2, no limit
    assert config.memory_limit() is None
    limit_file.write_text("9223372036854771712\n")  # cgroup v1, no limit
    assert config.memory_limit() is None
    limit_file.write_text(f"{2 << 30}\n")
    assert config.memory_limit() == 2 << 30 and config.default_max_dirty() == min(ram, 2 << 30) // 4
    assert build_config(tmp_path / "m").max_dirty == min(ram, 2 << 30) // 4
    limit_file.write_text(f"{512 << 20}\n")
    assert config.default_max_dirty() == 256 << 20  # the floor


def test_the_native_front_end_is_the_only_one(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFS_FRONTEND", raising=False)
    assert build_config(tmp_path / "mnt").frontend == "native"
    assert build_config(tmp_path / "mnt", frontend="native").frontend == "native"
    with pytest.raises(ConfigError, match="removed"):
        build_config(tmp_path / "mnt", frontend="pyfuse3")
    monkeypatch.setenv("KVFS_FRONTEND", "pyfuse3")
    with pytest.raises(ConfigError, match="removed"):
        build_config(tmp_path / "mnt")
