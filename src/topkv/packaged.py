"""Files shipped inside the package (``topkv/data``, see its README for sources and licenses).

A user's clone or wheel has nothing beside it, so every default input the commands need
(the demo's trace sample, the demo's emulated-node topology) lives here.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"

#: The first 4,000 requests of the Azure LLM inference trace 2023, conversation (CC-BY 4.0).
SAMPLE_TRACE = DATA_DIR / "azure_2023_conv_first4000.csv"

#: The first day of ServeGen's 162 language m-large clients' request rates (Apache-2.0): a
#: rate table (:mod:`topkv.traces`), 144 ten-minute windows per client.
SERVEGEN_DAY = DATA_DIR / "servegen_m_large_day1.csv.gz"

#: ``nvidia-smi topo -m`` of an 8x H100 NV18 server with 8 NICs (sglang issue #30401).
H100_TOPOLOGY = DATA_DIR / "sglang-30401-h100-8gpu-nv18-8nic.txt"


def packaged_file(name: str) -> Path | None:
    """``topkv/data/NAME`` when the package ships it (plain names only), else None."""
    if not name or Path(name).name != name:
        return None
    candidate = DATA_DIR / name
    return candidate if candidate.is_file() else None
