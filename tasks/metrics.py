"""Text metrics for seqio tasks (`metric_fns=[...]`): `fn(targets, predictions) -> dict`.

Targets and predictions are the decoded strings seqio hands a task's metric functions.
"""

from __future__ import annotations

from collections.abc import Sequence


def exact_match(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Percentage of predictions equal to their target (surrounding whitespace ignored)."""
    if not targets:
        return {"exact_match": 0.0}
    hits = sum(t.strip() == p.strip() for t, p in zip(targets, predictions))
    return {"exact_match": 100.0 * hits / len(targets)}


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Corpus BLEU (sacrebleu's defaults: 13a tokenization, exponential smoothing)."""
    import sacrebleu

    return {"bleu": sacrebleu.corpus_bleu(list(predictions), [list(targets)]).score}


def rouge(targets: Sequence[str], predictions: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-Lsum F-measures (x100)."""
    from rouge_score import rouge_scorer, scoring

    kinds = ("rouge1", "rouge2", "rougeLsum")
    scorer = rouge_scorer.RougeScorer(kinds)
    aggregator = scoring.BootstrapAggregator()
    for target, prediction in zip(targets, predictions):
        aggregator.add_scores(scorer.score(target, prediction))
    result = aggregator.aggregate()
    return {k: 100.0 * result[k].mid.fmeasure for k in kinds}
