"""The host, watched while a Snakemake run goes: nvidia-smi per GPU, RSS over Snakemake's process tree,
the host's disk writes, and what the host has (GPU name and count)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time


class Sampler:
    """Every `every` s: nvidia-smi per GPU, RSS summed over `root`'s process tree, host disk write bytes."""

    def __init__(self, root_pid: int, every: float = 1.0):
        import psutil

        self.psutil, self.root, self.every = psutil, root_pid, every
        self.smi = shutil.which("nvidia-smi")
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _tree_rss(self) -> int:
        total = 0
        with contextlib.suppress(self.psutil.NoSuchProcess):
            root = self.psutil.Process(self.root)
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(self.psutil.Error):  # a process may exit while we look
                    total += p.memory_info().rss
        return total

    def _gpus(self) -> dict[str, list[int]] | None:
        if not self.smi:
            return None
        try:
            out = subprocess.run(
                [self.smi, "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
        except (subprocess.SubprocessError, OSError):
            return None
        gpus = {}
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and all(p.isdigit() for p in parts):
                gpus[parts[0]] = [int(parts[1]), int(parts[2])]
        return gpus

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            disk = self.psutil.disk_io_counters()
            self.samples.append(
                {
                    "t": round(t, 3),
                    "rss": self._tree_rss(),
                    "disk_write_bytes": disk.write_bytes if disk else None,
                    "mem_used": self.psutil.virtual_memory().used,
                    "gpus": self._gpus(),
                }
            )
            self._stop.wait(max(0.0, self.every - (time.time() - t)))

    def stop(self) -> list[dict]:
        self._stop.set()
        self._t.join()
        return self.samples


def host_summary(samples: list[dict], window: tuple[float, float] | None) -> dict:
    """Peak tree RSS, and the host's disk write rate (peak between two samples, mean over `window`)."""
    import psutil

    inside = [s for s in samples if window is None or window[0] <= s["t"] <= window[1]] or samples
    rates = [
        (b["disk_write_bytes"] - a["disk_write_bytes"]) / (b["t"] - a["t"])
        for a, b in zip(samples, samples[1:], strict=False)
        if a["disk_write_bytes"] is not None and b["disk_write_bytes"] is not None and b["t"] > a["t"]
    ]
    mean = None
    if len(inside) > 1 and inside[0]["disk_write_bytes"] is not None and inside[-1]["t"] > inside[0]["t"]:
        mean = (inside[-1]["disk_write_bytes"] - inside[0]["disk_write_bytes"]) / (inside[-1]["t"] - inside[0]["t"])
    return {
        "rss_peak_bytes": max((s["rss"] for s in samples), default=0),
        "host_mem_used_peak_bytes": max((s["mem_used"] for s in samples), default=0),
        "host_mem_total_bytes": psutil.virtual_memory().total,
        "disk_write_peak_bps": round(max(rates), 1) if rates else None,
        "disk_write_mean_bps_capture": round(mean, 1) if mean is not None else None,
    }


def gpu_name() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "no nvidia-smi"
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return (out.stdout.splitlines() or ["?"])[0].strip()


def host_gpu_count(args) -> int:
    from eagle3prep.infra.gpus import count_gpus

    if args.device == "cpu":
        return int(os.environ.get("EAGLE3PREP_NUM_GPUS") or args.host_gpus)
    return count_gpus()
