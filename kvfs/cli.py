"""The `kvfs` command: mount, umount, stat."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from .config import CODECS, DTYPES, ConfigError, build_config
from .stats import human_bytes as _human

MOUNT_WAIT_S = 30.0


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    """The version, then what the optional native parts found on this host (a wheel's user asks this first)."""
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import version

    click.echo(f"kvfs, version {version('kvfs')}")
    try:
        from .codecs import kernel

        click.echo(f"codec kernel: built in (libzstd in the kernel: {'yes' if kernel.ZSTD_IN_KERNEL else 'no'})")
    except ImportError as e:
        click.echo(f"codec kernel: absent ({e})")
    try:
        from .frontend import _loop  # noqa: F401

        click.echo("native front end: available")
    except ImportError as e:
        click.echo(f"native front end: unavailable ({e})")
    from .codecs import qat

    try:
        click.echo(f"QATzip: {qat.load().path} (codec qat)")
    except qat.QatUnavailable:
        click.echo(f"QATzip: absent (codec qat unavailable; deflate writes the same format; {qat.ENV_LIB} "
                   "names the library)")
    ctx.exit()


@click.group()
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Show the version and the optional native parts found, then exit.")
def main() -> None:
    """kvfs: a compressed, checksummed, tiered filesystem for LLM KV caches."""


# Every option of `kvfs mount` can also come from the environment, KVFS_MOUNT_<OPTION> (KVFS_MOUNT_L2,
# KVFS_MOUNT_CODEC, KVFS_MOUNT_ALLOW_OTHER=1, KVFS_MOUNT_L3="DIR:SIZE DIR:SIZE", …): containers configure it so
# (docs/deploy.md). The command line wins over the environment, and both over the TOML file.
@main.command(context_settings={"auto_envvar_prefix": "KVFS_MOUNT"})
@click.argument("mountpoint", type=click.Path(file_okay=False, path_type=Path))
@click.option("--l2", metavar="DIR:SIZE", help="L2 tier directory (normally tmpfs) and capacity, e.g. /dev/shm/kvfs:8G")
@click.option("--l3", metavar="DIR:SIZE", multiple=True,
              help="L3 tier directory (normally local SSD) and capacity, or 'none' (default: STATE_DIR/l3, 16G); "
                   "repeat it for several directories, one per SSD, each with its own capacity")
@click.option("--l4", metavar="s3://BUCKET/PREFIX|DIR",
              help="L4 tier: an S3-compatible store (endpoint and credentials from AWS_ENDPOINT_URL, "
                   "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS config files or the [l4] TOML section) or a "
                   "directory on a distributed filesystem; L3 demotes to it instead of deleting")
@click.option("--l4-capacity", metavar="SIZE", help="L4 capacity for this mount's private prefix (default unlimited)")
@click.option("--l4-path-style/--l4-virtual-host", default=None,
              help="S3 addressing (default: path-style when an endpoint is configured, as RGW and MinIO need)")
@click.option("--l4-shared", is_flag=True, default=None,
              help="the L4 prefix is one namespace for every mount on it: files published by path, immutable "
                   "once there, first writer of a name wins")
@click.option("--l4-takeover", is_flag=True,
              help="take over a private L4 another mount owns once its lease has expired (its owner is gone); "
                   "this mount's reconcile then deletes the objects the previous owner's index named")
@click.option("--force", is_flag=True, help="take over a private L4 another mount owns now, even while it lives")
@click.option("--l4-write", type=click.Choice(["demote", "through"]),
              help="demote (default): files reach L4 when L3 demotes them; through: every committed file is also "
                   "published to the shared L4 a second after its last close")
@click.option("--promote", metavar="POLICY",
              help="when a file read from L3 moves back to L2: always (default), never, or a number of reads")
@click.option("--idle", metavar="DURATION",
              help="idle policy: a file not read for DURATION (e.g. 10m) goes down a tier, one more per further "
                   "DURATION; off (default); per file or directory: user.kvfs.idle")
@click.option("--codec", type=click.Choice(CODECS),
              help="codec for new frames (default auto: per file, the smallest on a sample; entropy = the "
                   "2-byte-float coder, entropy8 = the 1-byte-float (fp8) coder); qat = deflate on Intel QAT via "
                   "QATzip, deflate = the same format through ISA-L")
@click.option("--dtype", type=click.Choice(DTYPES),
              help="element type of stored data: byte planes for 2-byte floats, codec entropy8 for fp8 (default auto: "
                   "per file from a sample)")
@click.option("--lossy", "lossy_mode", metavar="MODE", envvar="KVFS_MOUNT_LOSSY",
              help="opt-in lossy mode for all files of known dtype: none (default), mantissa:K (drop K mantissa "
                   "bits), fp8[:G] (FP8 E4M3, one scale per G values); per file or directory: user.kvfs.lossy")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              envvar="KVFS_MOUNT_CONFIG", help="TOML configuration file")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), help="where the index lives")
@click.option("--allow-other", is_flag=True, default=None, help="let other users access the mount")
@click.option("--frontend", metavar="native",
              help="the FUSE front end: native (libfuse's multi-threaded loop in C threads, kvfs/frontend; "
                   "docs/frontend.md), the only one since pyfuse3's was removed")
@click.option("--foreground", "-f", is_flag=True, help="stay in the foreground, log to stderr")
@click.option("--log-file", type=click.Path(dir_okay=False, path_type=Path), help="log file (background mode)")
@click.option("--debug", is_flag=True, help="verbose logging")
@click.option("--metrics-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (docs/metrics.md)")
@click.option("--metrics-address", metavar="ADDR", help="address the metrics port binds to (default 127.0.0.1)")
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path),
              help="encryption at rest: a file of 32 random bytes, mode 0600 (or KVFS_KEY=64 hex digits)")
@click.option("--old-key-file", "old_key_files", multiple=True, envvar="KVFS_MOUNT_OLD_KEY_FILE",
              type=click.Path(dir_okay=False, path_type=Path),
              help="a rotated-out key whose objects stay readable (repeatable)")
@click.option("--tenant-key", "tenant_keys", multiple=True, envvar="KVFS_MOUNT_TENANT_KEY",
              metavar="DIR=KEYFILE[,OLD...]",
              help="a directory (relative to the mount) whose files are sealed in every tier with a key of its own "
                   "(repeatable); deleting that key shreds them")
@click.option("--encrypt", metavar="TIERS",
              help="tiers that hold sealed objects only, e.g. L4 (the default with a key), L3,L4, or none")
@click.option("--events", "events_endpoint", metavar="ENDPOINT", envvar="KVFS_MOUNT_EVENTS",
              help="publish KV events (vLLM's wire format) on a ZMQ PUB endpoint, e.g. tcp://*:5557 (docs/events.md)")
@click.option("--events-replay", "events_replay", metavar="ENDPOINT",
              help="a ZMQ ROUTER endpoint where subscribers replay missed event batches, e.g. tcp://*:5558")
def mount(mountpoint, l2, l3, l4, l4_capacity, l4_path_style, l4_shared, l4_takeover, force, l4_write, promote, idle, codec, dtype, lossy_mode, config_file, state_dir, allow_other, frontend,
          foreground, log_file, debug, metrics_port, metrics_address, key_file, old_key_files, tenant_keys, encrypt,
          events_endpoint, events_replay):
    """Mount kvfs at MOUNTPOINT (an embedded default configuration works with no options)."""
    try:
        cfg = build_config(mountpoint, config_file=config_file, l2=l2, l3=l3 or None, l4=l4, l4_capacity=l4_capacity,
                           l4_path_style=l4_path_style, l4_shared=l4_shared, l4_write=l4_write,
                           promote=promote, idle=idle, codec=codec,
                           dtype=dtype, lossy_mode=lossy_mode, state_dir=state_dir, allow_other=allow_other, frontend=frontend,
                           foreground=foreground, debug=debug, log_file=log_file, metrics_port=metrics_port,
                           metrics_address=metrics_address,
                           l4_takeover="force" if force else "expired" if l4_takeover else None,
                           key_file=key_file, old_key_files=old_key_files, encrypt=encrypt,
                           tenant_keys=tenant_keys, events=events_endpoint, events_replay=events_replay)
        if cfg.encryption.enabled:
            from .daemon import load_keyring

            load_keyring(cfg)  # a key file that cannot be used stops the mount here, before it detaches
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if cfg.codec == "qat":
        from .codecs import qat

        try:
            qat.load()
        except qat.QatUnavailable as e:
            raise click.UsageError(str(e)) from None
    if not cfg.mountpoint.is_dir():
        raise click.UsageError(f"mountpoint {cfg.mountpoint} is not a directory")
    if os.path.ismount(cfg.mountpoint):
        raise click.UsageError(f"{cfg.mountpoint} is already a mount point")
    if foreground:
        from .daemon import run, setup_logging

        setup_logging(cfg)
        sys.exit(run(cfg))
    _mount_in_background(cfg, sys.argv[2:])


def _mount_in_background(cfg, argv: list[str]) -> None:
    """Re-run ourselves in the foreground as a detached process; return once the mount is live."""
    log_file = cfg.log_file or (cfg.state_dir / "kvfs.log")
    log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    args = [sys.executable, "-m", "kvfs", "mount", "--foreground", *argv]
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + MOUNT_WAIT_S
    while time.monotonic() < deadline:
        if os.path.ismount(cfg.mountpoint):
            click.echo(f"kvfs mounted at {cfg.mountpoint} (pid {proc.pid}, log {log_file})")
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    tail = log_file.read_text(errors="replace").splitlines()[-15:]
    raise click.ClickException("mount failed:\n" + "\n".join(tail))


@main.command()
@click.argument("mountpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--lazy", "-z", is_flag=True, help="detach now even if busy")
@click.option("--timeout", default=60.0, show_default=True, help="seconds to wait for the daemon to finish")
def umount(mountpoint, lazy, timeout):
    """Unmount MOUNTPOINT and wait until its daemon has flushed and exited."""
    pid = None
    try:
        pid = json.loads((mountpoint / ".kvfs" / "stats").read_bytes())["pid"]
    except (OSError, ValueError, KeyError):
        pass
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
    res = subprocess.run([tool, "-u", *(["-z"] if lazy else []), str(mountpoint)], capture_output=True, text=True)
    if res.returncode != 0:
        raise click.ClickException(res.stderr.strip() or f"{tool} failed")
    if pid is not None and not _wait_gone(pid, timeout):
        raise click.ClickException(f"daemon {pid} still running after {timeout}s")


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _exited(pid):
            return True
        time.sleep(0.05)
    return False


def _exited(pid: int) -> bool:
    """True once the process has exited, even if its parent has not reaped it yet: a zombie has flushed and
    released everything, and only its parent (not us) can make it disappear, so kill(pid, 0) alone would wait
    for a parent that may never call wait()."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone (and reaped), or vanishing while we read
        return True
    except OSError:  # no procfs: fall back to the signal probe, which sees zombies as alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    # the state is the first field after the command name, which is in parentheses and may contain anything
    state = stat.rpartition(")")[2].split()[0]
    return state in ("Z", "X")


@main.command()
@click.argument("url", metavar="s3://BUCKET/PREFIX")
@click.option("--max-size", metavar="SIZE", help="delete least recently used files until the prefix holds this much")
@click.option("--max-age", metavar="DURATION", help="delete files not read for this long (e.g. 12h, 7d)")
@click.option("--dry-run", is_flag=True, help="say what would go, delete nothing")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="TOML file whose [l4] section says how to reach the store (endpoint, credentials)")
def gc(url, max_size, max_age, dry_run, config_file):
    """Keep a shared L4 prefix within its capacity: files past their retention time (user.kvfs.ttl) go, then
    least recently used published files while the prefix is over --max-size or they are older than --max-age.

    Run by one owner (a timer), never by the mounts; reads logged by every mount count as uses."""
    from . import gc as gc_mod
    from .config import _l4_config, load_toml, parse_duration, parse_size

    try:
        section = load_toml(config_file).get("l4", {}) if config_file else {}
        section = {k: v for k, v in section.items() if k not in ("url", "capacity")}
        tier = _l4_config({**section, "shared": True}, url, None, None)
        max_bytes = parse_size(max_size) if max_size else None
        max_age_s = parse_duration(max_age) if max_age else None
    except (ConfigError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    if tier is None or tier.s3 is None:
        raise click.UsageError("kvfs gc works on an s3:// prefix")
    try:
        report = gc_mod.collect(tier.s3, max_bytes, max_age_s, dry_run)
    except OSError as e:
        raise click.ClickException(e.strerror or str(e)) from None
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{tier.s3.url}: {report.files} files, {_human(report.bytes)}; {verb} {report.deleted_files} "
               f"({_human(report.deleted_bytes)}), {_human(report.bytes - report.deleted_bytes)} left; "
               f"{report.logs_compacted} access logs compacted")
    for fid in report.deleted:
        click.echo(f"  {verb} {fid}")


@main.command(name="stat")
@click.argument("mountpoint", metavar="MOUNTPOINT|FILE", type=click.Path(exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the raw JSON")
def stat_cmd(mountpoint, as_json):
    """Show per-tier usage, compression and error counters of a mounted kvfs; or, for a file in one, where it
    lies and how it is stored (the user.kvfs.* attributes readable by name, which listxattr does not list)."""
    if not mountpoint.is_dir():
        _file_stat(mountpoint, as_json)
        return
    try:
        raw = (mountpoint / ".kvfs" / "stats").read_bytes()
    except OSError as e:
        raise click.ClickException(f"{mountpoint} does not look like a kvfs mount: {e.strerror}") from None
    doc = json.loads(raw)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    from rich.table import Table

    tiers = Table(title=f"kvfs at {doc['mountpoint']} (pid {doc['pid']}, codec {doc['codec']})")
    columns = ("tier", "path", "used", "capacity", "use %", "files", "logical", "ratio", "hits", "demoted",
               "promoted", "evicted")
    for col in columns:
        tiers.add_column(col, justify="left" if col in ("tier", "path") else "right")
    for name, t in doc["tiers"].items():
        pct = 100 * t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else 0
        capacity = "unlimited" if t["capacity_bytes"] >= 1 << 60 else _human(t["capacity_bytes"])
        tiers.add_row(name, t["path"], _human(t["used_bytes"]), capacity, f"{pct:.1f}",
                      str(t["files"]), _human(t["logical_bytes"]),
                      "-" if t["compression_ratio"] is None else f"{t['compression_ratio']:.3f}",
                      str(t["hits"]), _moved(t["demoted_files"], t["demoted_bytes"]),
                      _moved(t["promoted_files"], t["promoted_bytes"]), _moved(t["evicted_files"], t["evicted_bytes"]))
    mover = doc["mover"]
    tiers.caption = (f"mover: promotion {mover['promotion']}, "
                     f"draining {', '.join(mover['draining']) or 'nothing'}, backlog {_human(mover['backlog_bytes'])}, "
                     f"{mover['promotions_queued']} promotions queued, {doc['writer_waits']} writer waits "
                     f"({doc['writer_wait_s']:.1f} s), {doc['move_failures']} failed moves"
                     + (f"; QAT: {doc['qat']['mode']}" if doc.get("qat", {}).get("mode") != "not loaded" else "")
                     + "".join(f"; {name} {t['endpoint']}: " + ", ".join(f"{n} {k}" for k, n in t["requests"].items())
                               + f", {_human(t['bytes_uploaded'])} up, {_human(t['bytes_downloaded'])} down, "
                               f"{t['failures']} failures, circuit {t['breaker']}"
                               for name, t in doc["tiers"].items() if "requests" in t))
    if doc.get("quotas"):
        quota_table = Table(title="quotas")
        for col in ("directory", "tier", "used", "quota", "use %"):
            quota_table.add_column(col, justify="left" if col in ("directory", "tier") else "right")
        for q in doc["quotas"]:
            for tier, limit in q["limits"].items():
                used = q["used"].get(tier, 0)
                quota_table.add_row(q["path"], tier, _human(used), _human(limit), f"{100 * used / limit:.1f}")
    directories = [_directory_table(name, t["directories"]) for name, t in doc["tiers"].items() if t.get("directories")]
    counters = Table(show_header=False, title="counters")
    for key in ("bytes_written", "bytes_read", "direct_reads", "direct_bytes", "commits", "commit_failures",
                "checksum_failures", "errors", "open_files", "dirty_bytes", "compression_ratio"):
        value = doc.get(key)
        counters.add_row(key, _human(value) if key.startswith(("bytes", "dirty", "direct_bytes")) else str(value))
    from .console import table_console  # rich loads only for the commands that print tables

    console = table_console()
    console.print(tiers)
    for table in directories:
        console.print(table)
    if doc.get("quotas"):
        console.print(quota_table)
    console.print(counters)


def _file_stat(path: Path, as_json: bool) -> None:
    import dataclasses

    from . import client

    try:
        st = client.status(path)
    except client.KvfsError as e:
        raise click.ClickException(e.strerror) from None
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(st), indent=2))
        return
    ratio = f" ({st.stored_bytes / st.size:.3f} of the logical size)" if st.size and st.stored_bytes else ""
    rows = [("tier", st.tier), ("pinned", "yes" if st.pinned else "no"),
            ("idle", f"{st.idle_s} s" if st.idle_s else "never"),
            ("ttl", f"{st.ttl_s} s" if st.ttl_s else "none"), ("codec", st.codec), ("transform", st.transform),
            ("size", f"{st.size} ({_human(st.size)})"), ("stored", f"{st.stored_bytes}{ratio}")]
    click.echo(st.path)
    for key, value in rows:
        click.echo(f"  {key:<10} {value}")


def _directory_table(tier: str, directories: list[dict]):
    """A row per directory of a tier spread over several (L3 on several SSDs)."""
    from rich.table import Table

    table = Table(title=f"{tier} directories")
    for col in ("directory", "state", "used", "capacity", "use %", "files", "written", "read", "failures"):
        table.add_column(col, justify="left" if col in ("directory", "state") else "right")
    for d in directories:
        pct = 100 * d["used_bytes"] / d["capacity_bytes"] if d["capacity_bytes"] else 0
        state = f"{d['state']} ({d['reason']})" if d.get("reason") else d["state"]
        table.add_row(d["path"], state, _human(d["used_bytes"]), _human(d["capacity_bytes"]), f"{pct:.1f}",
                      str(d["files"]), _moved(d["written_files"], d["written_bytes"]), _human(d["read_bytes"]),
                      str(d["failures"]))
    return table


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("size", required=False, metavar="[SIZE|TIER=SIZE,...|none]")
def quota(directory, size):
    """Show or set the quota of a directory in a kvfs mount: the stored bytes of the files below it, per tier
    (a bare SIZE bounds the fastest tier, L2). Over it, its own least recently used files move out first."""
    from .quotas import XA_QUOTA

    try:
        if size is not None:
            os.setxattr(directory, XA_QUOTA, size.encode())
        try:
            value = os.getxattr(directory, XA_QUOTA).decode()
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
            value = "none"
    except OSError as e:
        why = "not a valid quota (e.g. 4G, or L2=4G,L3=100G, or none)" if e.errno == errno.EINVAL else e.strerror
        raise click.ClickException(f"{directory}: {why}") from None
    used = ""
    try:
        mount = _mount_of(directory)
        doc = json.loads((mount / ".kvfs" / "stats").read_bytes())
        rel = str(directory.resolve().relative_to(mount))
        for q in doc.get("quotas", []):
            if q["path"] == rel:
                used = "; used " + ", ".join(f"{t} {_human(q['used'].get(t, 0))}" for t in q["limits"])
    except (OSError, ValueError):
        pass
    click.echo(f"{directory}: quota {value}{used}")


def _mount_of(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path




@main.command()
@click.argument("mountpoint", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1),
              help="seconds between refreshes")
@click.option("--count", type=click.IntRange(min=1), help="stop after N refreshes (default: until Ctrl-C)")
@click.option("--plain", is_flag=True, help="print the view at each refresh instead of redrawing it "
                                            "(the default when stdout is not a terminal)")
def top(mountpoint, interval, count, plain):
    """A live view of a mounted kvfs: tiers, hits, moves and throughput, refreshed every INTERVAL seconds."""
    from . import top as top_view

    try:
        top_view.run(mountpoint, interval, count, plain)
    except top_view.NotAMount as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        pass


@main.command()
@click.argument("mountpoint", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--repair", is_flag=True,
              help="drop files whose object is corrupt or missing (a miss), adopt complete copies, remove orphans")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="offline: the TOML of an unmounted kvfs ([mount] mountpoint or state_dir, tier paths)")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), help="offline: where the index lives")
@click.option("--l2", metavar="DIR:SIZE", help="offline: the L2 tier, as for kvfs mount")
@click.option("--l3", metavar="DIR:SIZE", multiple=True, help="offline: the L3 tier, as for kvfs mount")
@click.option("--l4", metavar="s3://BUCKET/PREFIX|DIR", help="offline: the L4 tier, as for kvfs mount")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def fsck(mountpoint, repair, config_file, state_dir, l2, l3, l4, as_json):
    """Verify every object's checksums and the index against the tiers; --repair fixes what is found.

    With MOUNTPOINT the mount's daemon checks while it serves; without it (--config FILE, or --state-dir and
    --l2) an unmounted state directory is checked. Exit status: 0 clean, 1 errors found and all repaired,
    4 errors left uncorrected, 8 the check could not run. See docs/fsck.md."""
    from . import cli_fsck

    offline_options = config_file or state_dir or l2 or l3 or l4
    if mountpoint is not None:
        if offline_options:
            raise click.UsageError("a mounted kvfs is checked by its daemon: give MOUNTPOINT alone")
        sys.exit(cli_fsck.live(mountpoint, repair, as_json))
    if not offline_options:
        raise click.UsageError("give MOUNTPOINT (a mounted kvfs) or --config FILE (an unmounted one)")
    try:
        cfg = build_config(None, config_file=config_file, l2=l2, l3=l3 or None, l4=l4, state_dir=state_dir)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(cli_fsck.offline(cfg, repair, as_json))


@main.command()
@click.argument("target", metavar="MOUNTPOINT|ENDPOINT")
@click.option("--replay", metavar="ENDPOINT", help="the publisher's replay endpoint (default: the mount's)")
@click.option("--from", "start", type=click.IntRange(min=0), metavar="SEQ",
              help="first replay the buffered batches from sequence number SEQ on (0: all the publisher keeps)")
@click.option("--count", type=click.IntRange(min=1), help="stop after N events")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per event")
@click.option("--topic", default="", help="the ZMQ topic to subscribe to (default: all)")
def events(target, replay, start, count, as_json, topic):
    """Print the KV events a mount publishes (--events): BlockStored / BlockRemoved per tier, as a router
    receives them. TARGET is a mountpoint or a ZMQ endpoint such as tcp://127.0.0.1:5557."""
    from . import cli_events

    try:
        cli_events.run(target, replay, start, count, as_json, topic)
    except KeyboardInterrupt:
        pass


def _moved(files: int, nbytes: int) -> str:
    return f"{files} ({_human(nbytes)})" if files else "0"


from .cli_hotcold import COMMANDS as _HOTCOLD  # noqa: E402  (commands of their own module)

for _command in _HOTCOLD:
    main.add_command(_command)

if __name__ == "__main__":
    main()
