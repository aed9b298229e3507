"""The sync client is generated from the async one (clients/_generate_sync.py), so the two never drift."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from clients import AsyncClient, Client, _generate_sync


def test_the_sync_client_in_use_is_what_the_generator_makes() -> None:
    made = _generate_sync.generate(_generate_sync.SOURCE.read_text())
    assert _generate_sync.TARGET.read_text() == made, "clients/client.py is stale: run `make gen`"


def test_check_mode_fails_on_a_hand_edited_sync_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    edited = tmp_path / "client.py"
    edited.write_text(_generate_sync.TARGET.read_text().replace("def append(", "def append_one(", 1))
    monkeypatch.setattr(_generate_sync, "TARGET", edited)
    assert _generate_sync.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert _generate_sync.main([]) == 0
    assert _generate_sync.main(["--check"]) == 0


def test_the_generator_refuses_a_source_its_table_no_longer_fits() -> None:
    source = _generate_sync.SOURCE.read_text()
    with pytest.raises(ValueError, match="exactly once"):
        _generate_sync.generate(source.replace("(grpc.aio channels belong to one loop)", "(one loop)"))
    with pytest.raises(ValueError, match="match nothing"):
        _generate_sync.generate(source.replace("__aexit__", "__aleave__"))


def _public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(cls).items()
        if callable(member) and (not name.startswith("_") or name == "__init__")
    }


def test_client_and_async_client_have_the_same_methods_and_parameters() -> None:
    sync, aio = _public_methods(Client), _public_methods(AsyncClient)
    assert sorted(sync) == sorted(aio)
    for name, signature in aio.items():
        assert list(sync[name].parameters) == list(signature.parameters), name
        for parameter in signature.parameters.values():
            twin = sync[name].parameters[parameter.name]
            where = f"{name}({parameter.name})"
            assert (twin.kind, twin.default) == (parameter.kind, parameter.default), where
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)) != (
            name in ("__init__", "subscribe", "subscribe_group", "consume", "publisher")
        ), name
        assert not inspect.iscoroutinefunction(getattr(Client, name)), name
