"""Powder ("Federated Continual Learning via Prompt-based Dual Knowledge Transfer"): task and class
correlation, two-step prompt aggregation, per-client top-k payloads, dual distillation."""

from promptfcl.strategies.registry import Method

METHOD = Method("powder", strategy=".strategy:PowderStrategy", learner=".learner:PowderLearner")
