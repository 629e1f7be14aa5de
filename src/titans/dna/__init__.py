"""DNA language modelling and sequence classification with Titans models (docs/domains.md)."""

from titans.dna.model import SequenceClassifier, dna_config, lm_bits_per_base
from titans.dna.study import DNABudget, run_study

__all__ = ["DNABudget", "SequenceClassifier", "dna_config", "lm_bits_per_base", "run_study"]
