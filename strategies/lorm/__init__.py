"""LoRM ("Closed-form merging of parameter-efficient modules for Federated Continual Learning"): low-rank
adapters on every projection of the frozen ViT, trained one factor at a time, merged on the server in
closed form (RegMean with diagonal Gram matrices) within a task and across tasks."""

from ..registry import Method

# The paper could not be read here beyond its abstract (arXiv 2410.17961; ICLR 2025, as the authors'
# repository aimagelab/fed-mammoth and its issue #2 say); the author list is the arXiv entry's first
# author only, so the entry says so rather than fill the rest from memory
CITATION = """\
@inproceedings{salami2025lorm,
  title = {Closed-form merging of parameter-efficient modules for Federated Continual Learning},
  author = {Salami, Riccardo and others},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year = {2025},
  note = {The abstract is the part of the paper this project holds; it names no other author},
}"""

METHOD = Method("lorm", strategy=".strategy:LoRMStrategy", learner=".learner:LoRMLearner",
                prompt=".prompt:LoRMAdapters", options=".options:LoRMOptions", citation=CITATION)
