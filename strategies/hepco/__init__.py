"""HePCo ("Continual Adaptation of Vision Transformers for Federated Learning"): latent generation and
distillation at the server, plain prompt clients."""

from ..registry import Method

# the text prints the authors and "Reviewed on OpenReview" with the forum's address, but no venue
# name and no year: the entry says so rather than guess them
CITATION = """\
@misc{halbe-hepco,
  title = {Continual Adaptation of Vision Transformers for Federated Learning},
  author = {Halbe, Shaunak and Smith, James Seale and Tian, Junjiao and Kira, Zsolt},
  howpublished = {Reviewed on OpenReview},
  url = {https://openreview.net/forum?id=vsZ5A3Zxyr},
  note = {The paper's text names no venue and no year},
}"""

METHOD = Method(
    "hepco", strategy=".strategy:HePCoStrategy", learner=".learner:HePCoLearner", prompt=".prompt:HePCoPrompt",
    options=".options:HePCoOptions", records=".records:PRIVATE_RECORDS", statistics=".records:STATISTICS",
    citation=CITATION,
    # the paper's FedAvg-Prompt baseline (Table 1): HePCo with both distillations ablated, so
    # the same prompts, averaging and clients, without the server's consolidation
    variants=(("baseline", (("ablate", "prompt-distillation,classifier-distillation"),)),),
)
