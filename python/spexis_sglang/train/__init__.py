"""Training pipeline for the draft head and the length predictor
(``python -m spexis_sglang.train``)."""
