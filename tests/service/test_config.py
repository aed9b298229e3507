"""Settings: precedence (defaults < TOML < environment < flags < --set) and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.cli import EXIT_USAGE, build_parser, serve_settings
from service.cli import main as cli_main
from service.config import ConfigError, Settings, engine_config, env_name, load_settings, setting_names
from storage import EngineConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "streamlog.toml"
    path.write_text(text)
    return path


def test_defaults_match_the_documented_command_line() -> None:
    settings = load_settings()
    assert (settings.data_dir, settings.host, settings.port, settings.fsync) == (
        Path("data"),
        "127.0.0.1",
        7070,
        "everysec",
    )


def test_each_source_overrides_the_one_before(tmp_path: Path) -> None:
    config = write(tmp_path, 'port = 7001\nhost = "0.0.0.0"\nfsync = "no"\nmax_entry_bytes = 2048\n')
    settings = load_settings(config_file=config)
    assert (settings.port, settings.host, settings.fsync, settings.max_entry_bytes) == (
        7001,
        "0.0.0.0",
        "no",
        2048,
    )

    env = {"STREAMLOG_PORT": "7002", "STREAMLOG_FSYNC": "always"}
    settings = load_settings(config_file=config, env=env)
    assert (settings.port, settings.host, settings.fsync) == (7002, "0.0.0.0", "always")

    settings = load_settings(config_file=config, env=env, flags={"port": 7003, "host": None})
    assert (settings.port, settings.host) == (7003, "0.0.0.0")  # a flag left out (None) overrides nothing

    settings = load_settings(config_file=config, env=env, flags={"port": 7003}, overrides={"port": "7004"})
    assert settings.port == 7004


def test_config_file_can_come_from_the_environment(tmp_path: Path) -> None:
    config = write(tmp_path, "port = 7123\n")
    assert load_settings(env={"STREAMLOG_CONFIG": str(config)}).port == 7123


def test_text_values_are_parsed_by_type() -> None:
    env = {
        "STREAMLOG_MAX_MESSAGE_BYTES": "32MiB",
        "STREAMLOG_MAX_BATCH_BYTES": "4_194_304",
        "STREAMLOG_COMPRESSION": "off",
        "STREAMLOG_DATA_DIR": "/var/lib/streamlog",
        "STREAMLOG_UNRELATED_CLIENT_SETTING": "ignored",
    }
    settings = load_settings(env=env)
    assert settings.max_message_bytes == 32 << 20
    assert settings.max_batch_bytes == 4 << 20
    assert settings.compression is False
    assert settings.data_dir == Path("/var/lib/streamlog")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"env": {"STREAMLOG_PORT": "seventy"}},
            "port: expected an integer, got 'seventy' (from environment",
        ),
        ({"env": {"STREAMLOG_PORT": "70000"}}, "port: must be between 0 and 65535, got 70000"),
        ({"env": {"STREAMLOG_PORT": "7MiB"}}, "port: expected an integer"),  # units only for sizes
        ({"env": {"STREAMLOG_COMPRESSION": "maybe"}}, "compression: expected true or false"),
        ({"env": {"STREAMLOG_FSYNC": "sometimes"}}, "fsync: must be one of always, everysec, no"),
        ({"overrides": {"colour": "blue"}}, "unknown setting 'colour' in --set"),
        ({"overrides": {"host": "  "}}, "host: must not be empty"),
        ({"env": {"STREAMLOG_METRICS_HOST": ""}}, "metrics_host: must not be empty"),
        ({"overrides": {"max_entry_bytes": "9MiB"}}, "max_entry_bytes (9437184, from --set max_entry_bytes)"),
        ({"overrides": {"default_read_entries": "20000"}}, "must not be larger than max_read_entries"),
        (
            {"overrides": {"max_read_bytes": "15MiB"}},
            "max_message_bytes (16777216, from the default) must hold",
        ),
        ({"overrides": {"append_threads": "0"}}, "append_threads: must be between 1 and 256"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(**kwargs)
    assert message in str(caught.value)


def test_a_segment_too_small_for_a_full_batch_says_what_to_change() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(overrides={"segment_bytes": "1MiB"})
    assert str(caught.value) == (
        "segment_bytes (1048576, from --set segment_bytes) is too small for one full batch, and a batch "
        "is never split across segments: it takes 8428928 bytes with max_batch_bytes=8388608 (from the "
        "default) and max_batch_entries=10000 (from the default). Raise segment_bytes to at least "
        "8428928, or lower max_batch_bytes to at most 1008256 (e.g. 984KiB) and max_entry_bytes to no "
        "more than that"
    )
    # Following the advice works; so does the engine's own check of the same rule.
    settings = load_settings(
        overrides={"segment_bytes": "1MiB", "max_batch_bytes": "984KiB", "max_entry_bytes": "984KiB"}
    )
    assert engine_config(settings).segment_bytes == 1 << 20
    with pytest.raises(ConfigError, match=r"9588928, or lower max_batch_entries and max_batch_bytes$"):
        load_settings(overrides={"segment_bytes": "1MiB", "max_batch_entries": "300000"})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port = 'x'\n", "port: expected an integer, got 'x' (from config file"),
        ("compression = 1\n", "compression: expected a boolean"),
        ("port = true\n", "port: expected an integer"),
        ("nonsense = 1\n", "unknown setting 'nonsense' in config file"),
        ("port = \n", "is not valid TOML"),
    ],
)
def test_bad_config_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(config_file=write(tmp_path, text))
    assert message in str(caught.value)


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(config_file=tmp_path / "nope.toml")


def test_every_setting_has_an_environment_variable_and_reaches_the_engine() -> None:
    names = setting_names()
    assert len(names) == len(set(names))
    assert env_name("max_entry_bytes") == "STREAMLOG_MAX_ENTRY_BYTES"
    settings = Settings(fsync="always", max_entry_bytes=1234, node_entries=77)
    config = engine_config(settings)
    assert (config.fsync, config.max_entry_bytes, config.node_entries) == ("always", 1234, 77)


def test_small_streams_is_slots_by_default_and_off_reaches_the_engine() -> None:
    assert engine_config(load_settings()).small_streams == "slots"
    assert EngineConfig().small_streams == "slots"  # a script's engine as a server's
    assert engine_config(load_settings(overrides={"small_streams": "off"})).small_streams == "off"
    with pytest.raises(ConfigError, match="small_streams"):
        load_settings(overrides={"small_streams": "packs"})


CLUSTER = {"cluster": "127.0.0.1:2379,etcd-1:2379", "node_id": "n1", "advertise": "10.0.0.5:7070"}


def test_a_single_server_needs_no_cluster_settings_and_a_clustered_node_parses_them() -> None:
    settings = load_settings()
    assert (settings.cluster, settings.cluster_name, settings.lease_ttl_ms) == ("", "streamlog", 5000)
    assert (settings.default_replication_factor, settings.default_acks, settings.replica_lag_ms) == (
        3,
        "quorum",
        2000,
    )
    env = {
        "STREAMLOG_LEASE_TTL_MS": "2000",
        "STREAMLOG_DEFAULT_ACKS": "leader",
        "STREAMLOG_PEER_ADDRESSES": "n2=127.0.0.1:17072, n3=[::1]:17073",
    }
    settings = load_settings(env=env, flags=CLUSTER)
    assert (settings.cluster, settings.node_id, settings.advertise) == tuple(CLUSTER.values())
    assert (settings.lease_ttl_ms, settings.default_acks) == (2000, "leader")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"node_id": "n1"}, "node_id is set (from --set node_id) but cluster is not"),
        ({"cluster": "127.0.0.1:2379", "advertise": "h:1"}, "node_id: a node in a cluster needs one"),
        ({"cluster": "127.0.0.1:2379", "node_id": "n1"}, "advertise: a node in a cluster needs one"),
        ({**CLUSTER, "cluster": "127.0.0.1"}, "cluster: expected HOST:PORT with a port from 1 to 65535"),
        ({**CLUSTER, "cluster": "a:1,a:1"}, "cluster: an etcd endpoint is listed twice"),
        ({**CLUSTER, "cluster": " , "}, "cluster: expected one or more etcd endpoints"),
        ({**CLUSTER, "node_id": "n/1"}, "node_id: a node id must be 1 to 63 letters"),
        ({**CLUSTER, "advertise": "host:0"}, "advertise: expected HOST:PORT"),
        ({**CLUSTER, "cluster_name": "a b"}, "cluster_name: the cluster name must be"),
        ({**CLUSTER, "peer_addresses": "n2"}, "peer_addresses: expected ID=HOST:PORT, got 'n2'"),
        ({**CLUSTER, "peer_addresses": "n2=h:1,n2=h:2"}, "peer_addresses: node 'n2' is listed twice"),
        ({"peer_ca_file": __file__}, "peer_ca_file is set (from --set peer_ca_file) but cluster is not"),
        ({**CLUSTER, "peer_ca_file": "/no/such/ca.pem"}, "peer_ca_file: /no/such/ca.pem is not a readable"),
        (
            {"cluster_secret_file": __file__},
            "cluster_secret_file is set (from --set cluster_secret_file) but",
        ),
        (
            {**CLUSTER, "cluster_secret_file": "/no/secret"},
            "cluster_secret_file: /no/secret is not a readable",
        ),
        ({**CLUSTER, "replica_fetch_bytes": "10"}, "replica_fetch_bytes: must be between 1024 and 4194304"),
        ({**CLUSTER, "max_concurrent_moves": "0"}, "max_concurrent_moves: must be between 1 and 1000"),
        ({**CLUSTER, "move_bytes_per_s": str(1 << 41)}, "move_bytes_per_s: must be between 0 and"),
        ({**CLUSTER, "replica_replace_after_ms": "2147483648"}, "replica_replace_after_ms: must be between"),
        ({**CLUSTER, "lease_ttl_ms": "2500"}, "lease_ttl_ms: etcd leases count whole seconds"),
        ({**CLUSTER, "lease_ttl_ms": "0"}, "lease_ttl_ms: must be between 1000 and 300000"),
        ({**CLUSTER, "default_acks": "all"}, "default_acks: must be one of leader, quorum"),
        (
            {**CLUSTER, "default_replication_factor": "0"},
            "default_replication_factor: must be between 1 and 64",
        ),
    ],
)
def test_bad_cluster_settings_are_refused_with_a_clear_message(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(overrides=overrides)
    assert message in str(caught.value)


def test_serve_takes_the_cluster_flags_and_checks_them(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--cluster", "127.0.0.1:2379", "--node-id", "n1", "--advertise", "127.0.0.1:7070"]
    settings = serve_settings(build_parser().parse_args(["serve", *flags]), env={})
    assert (settings.cluster, settings.node_id, settings.advertise) == (
        "127.0.0.1:2379",
        "n1",
        "127.0.0.1:7070",
    )
    # A bad value stops `serve` before anything starts, with the usage exit code.
    assert cli_main(["serve", "--cluster", "127.0.0.1:2379", "--node-id", "n1"]) == EXIT_USAGE
    assert "advertise: a node in a cluster needs one" in capsys.readouterr().err
