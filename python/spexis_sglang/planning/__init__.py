"""Planning SP deployments on GPUs we cannot measure: stage costs, presets, ranking.

``aic`` turns AIConfigurator's measured operator tables into per-stage GPU times (optional
extra ``spexis-sglang[planner]``); ``presets`` holds the host, link and calibration numbers of
the machines we measured; ``search`` ranks PP x TP x SP x alpha deployments with the
discrete-event simulator of ``spexis_sglang.core.pipeline_sim``.
"""
