"""curvalign's laboratory: the papers' claims as studies that can fail.

A sibling package of ``curvalign``, installed by the same distribution (as ``open_clip_train``
beside ``open_clip``): it drives the library (``curvalign.train.fitting.fit``,
``curvalign.eval``) and the library never imports it (an import-linter contract). The
``curvalign study`` command loads it when it runs.

``kit``       the shared machinery: ``Bench`` (seeded arms through ``fit``), the verdict rule
              ``decide``, Holm, the learning-rate grid
``rules``     the decision rules as pure functions: power planned on a pilot (exact noncentral
              t), stability across seed bases, the dose-response sizing of a control
``declare``   a study as a declaration (claims, arms, measures, control) and its runner
``studies``   one file per study
``graphs``    graph embedding from a hierarchy's edges (Nickel & Kiela's task), the trainer of
              ``wordnet-dimensions``
``runner``    ``run_study`` / ``run_all`` (``curvalign study NAME``)
``records``   a study's result as typed records (``StudyResult``, ``ClaimResult``) and its JSON
``results``   the results pages from the studies' JSON (``python -m curvalign_lab.results``)
"""
