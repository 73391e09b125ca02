"""HGP ("Reducing Bias in Federated Class-Incremental Learning with Hierarchical Generative
Prototypes"): per-class Gaussian prototypes from the clients, hierarchical sampling and classifier
rebalancing on the server."""

from ..registry import Method

# The text this project holds prints the title and the paper, but no authors, venue or year; the
# entry says so rather than fill them from memory
CITATION = """\
@misc{hgp,
  title = {Reducing Bias in Federated Class-Incremental Learning with Hierarchical Generative Prototypes},
  note = {The paper's text names no authors, no venue and no year},
}"""

METHOD = Method("hgp", strategy=".strategy:HGPStrategy", learner=".learner:HGPLearner", prompt=".prompt:HGPPrompt",
                records=".records:PRIVATE_RECORDS", statistics=".records:STATISTICS",
                options=".options:HGPOptions", citation=CITATION)
