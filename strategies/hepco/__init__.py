"""HePCo ("Continual Adaptation of Vision Transformers for Federated Learning"): latent generation and
distillation at the server, plain prompt clients."""

from promptfcl.strategies.registry import Method

METHOD = Method("hepco", strategy=".strategy:HePCoStrategy", learner=".learner:HePCoLearner")
