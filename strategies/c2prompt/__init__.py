"""C2Prompt ("C²Prompt: Class-aware Client Knowledge Interaction for Federated Continual Learning",
NeurIPS 2025): global class distributions of q(x), local class distribution compensation (LCDC)
and class-aware prompt aggregation (CPA) on a CODA-P prompt pool."""

from ..registry import Method

# Title, venue and the authors' surnames as the summaries this project could read give them (the
# paper's text could not be read; given names are not filled from memory); no code of the authors
# could be read either (its repository holds a README and the framework figure only)
CITATION = """\
@inproceedings{xu2025c2prompt,
  title = {C$^2$Prompt: Class-aware Client Knowledge Interaction for Federated Continual Learning},
  author = {Xu and Feng and Li and Qi and Zhou},
  booktitle = {Advances in Neural Information Processing Systems},
  year = {2025},
  note = {arXiv:2509.19674},
}"""

METHOD = Method("c2prompt", strategy=".strategy:C2PromptStrategy", learner=".learner:C2PromptLearner",
                prompt=".prompt:C2PromptPrompt", records=".records:PRIVATE_RECORDS", statistics=".records:STATISTICS",
                options=".options:C2PromptOptions", citation=CITATION)
