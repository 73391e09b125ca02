"""LoRM ("Closed-form merging of parameter-efficient modules for Federated Continual Learning"): low-rank
adapters on every projection of the frozen ViT, trained one factor at a time, merged on the server in
closed form (RegMean with diagonal Gram matrices) within a task and across tasks."""

from ..registry import Method

# The paper could not be read here beyond its abstract (arXiv 2410.17961; ICLR 2025, as the authors'
# repository aimagelab/fed-mammoth and its issue #2 say); the entry holds the first author's surname
# only, as the sources held here name it, rather than fill the author list from memory
CITATION = """\
@inproceedings{salami2025lorm,
  title = {Closed-form merging of parameter-efficient modules for Federated Continual Learning},
  author = {Salami and others},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year = {2025},
  note = {The abstract is the part of the paper held here; the full author list is not},
}"""

METHOD = Method("lorm", strategy=".strategy:LoRMStrategy", learner=".learner:LoRMLearner",
                prompt=".prompt:LoRMAdapters", options=".options:LoRMOptions", statistics=".records:STATISTICS",
                citation=CITATION)
