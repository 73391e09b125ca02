"""FPPL ("Federated Prototype-Augmented Prompt Learning"): fused task prompts, a prototype loss on the
clients, a prototype pool and classifier debiasing on the server."""

from promptfcl.strategies.registry import Method

METHOD = Method("fppl", strategy=".strategy:FPPLStrategy", learner=".learner:FPPLLearner")
