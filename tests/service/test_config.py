"""Settings: precedence (defaults < TOML < environment < flags < --set) and validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import ConfigError, Settings, engine_config, env_name, load_settings, setting_names


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
        ({"overrides": {"segment_bytes": "2MiB"}}, "storage engine settings: segment_bytes"),
        ({"overrides": {"append_threads": "0"}}, "append_threads: must be between 1 and 256"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(**kwargs)
    assert message in str(caught.value)


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
