"""Downstream evaluation: lm-evaluation-harness tasks scored by naohai models.

``engine``   the scoring engine (log-likelihoods through one compiled forward graph of fixed
             shape, greedy generation through the key/value-cache decode step); no lm-eval import.
``backend``  the ``lm_eval`` model class registered as ``naohai`` (needs ``pip install -e ".[eval]"``).
``tasks``    finding and checking tasks (shipped ones in ``naohai/downstream/shipped/``), running
             them, results as rows, the printed table and the results JSON.
"""
