"""The process settings a serving server runs with (service/server.py, `serve`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

# Runs `serve` in a process of its own (the settings are the process's), and once it is
# serving, allocates tracked objects that stay alive, as a call's batches and a load's new
# streams do, counting the garbage collections they set off.
PROBE = textwrap.dedent(
    """
    import asyncio, gc, json, sys
    from service.config import load_settings
    from service.server import serve

    async def main() -> None:
        settings = load_settings(env={}, flags={"data_dir": sys.argv[1], "port": 0})
        stop = asyncio.Event()

        async def probe() -> None:
            while not gc.get_freeze_count():  # serve freezes the start-up's objects once serving
                await asyncio.sleep(0.05)
            collections = []
            gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
            kept = [[] for _ in range(50_000)]
            print(json.dumps({"kept": len(kept), "collections": len(collections),
                              "switch_interval": sys.getswitchinterval()}))
            stop.set()

        prober = asyncio.create_task(probe())
        await serve(settings, stop)
        await prober

    asyncio.run(main())
    """
)


def test_a_serving_process_leaves_a_calls_objects_to_their_last_reference(tmp_path: Path) -> None:
    # At Python's young threshold (700 objects) these 50,000 set off about 70 young collections,
    # each walking every one still alive; the server walks them only past 100,000.
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"kept": 50_000, "collections": 0, "switch_interval": 0.0005}
