"""HePCo ("Continual Adaptation of Vision Transformers for Federated Learning"): latent generation and
distillation at the server, plain prompt clients."""

from promptfcl.strategies.registry import Method

METHOD = Method(
    "hepco", strategy=".strategy:HePCoStrategy", learner=".learner:HePCoLearner",
    # the paper's FedAvg-Prompt baseline (Table 1): HePCo with both distillations ablated, so
    # the same prompts, averaging and clients, without the server's consolidation
    variants=(("baseline", (("ablate", "prompt-distillation,classifier-distillation"),)),),
)
