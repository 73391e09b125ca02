"""Benchmarks: ``promptfcl bench perf`` (speed, memory, bytes) and ``promptfcl bench compare``.

These print figures; they are not tests. ``perf`` measures
* local training images/s of the real client loop against the compute bound (bare
  forward+backward+step of the same prompted ViT on the same batches), with and without
  the query cache;
* simulation seconds per round for 10, 100 and 1,000 clients at a fixed number sampled;
* peak resident memory of the server process and of one client actor;
* bytes per round per method against the size of a full ViT-B/16.
``compare`` runs every method plus FedAvg-Prompt and the centralised references on
identical task orders and client splits, for several seeds and heterogeneity levels,
and writes a Markdown and CSV table with plots; it and ``robustness`` run their grid through
``grid.run_grid`` (one after another, ``--parallel N`` at once, or on a Ray cluster).
``data-memory`` measures a client's peak
memory and first round on synthetic 224-px datasets of two sizes, with the memory-mapped
data cache and without. ``paper-dims`` runs one round of every
paper configuration at the papers' model dimensions (ViT-B/16 with random weights) on a
stand-in dataset with the paper's class count, and reports bytes, memory and time per
method next to the papers' figures. ``edge`` trains one client round at ViT-B/16 dimensions
within a node's memory budget per frozen-backbone precision (docs/edge.md). The compare
references are one client holding all data with FedAvg-Prompt's local training:
``upper-bound-incremental`` learns the tasks in turn (centralised incremental CODA-P) and
``upper-bound-joint`` trains at each task on the union of every task seen so far (the ceiling;
``centralised-mode``).
"""

from __future__ import annotations

import subprocess  # noqa: F401 (tests replace subprocess.Popen through this module)

from .attacks import DEFENCES, robustness
from .common import run_simulation_subprocess
from .comparison import compare, finished_run, parse_method, summary_table
from .data_memory import data_memory
from .deploy import deploy_overhead
from .edge import edge_rounds
from .grid_parts import GridInterrupted, Placement
from .paper_scale import paper_dims
from .speed import perf

__all__ = ["DEFENCES", "GridInterrupted", "Placement", "compare", "data_memory", "deploy_overhead", "edge_rounds",
           "finished_run", "paper_dims", "parse_method", "perf", "robustness", "run_simulation_subprocess",
           "summary_table"]
