"""The planner: the whole deployment plan for a core budget, pipelines and the alternatives alike.

It sits above the splitter, the builder and the runtime (it cuts, builds, exports and runs the plans
it measures), and none of them imports it. ``plan_pipeline(model, cores=C)`` considers one session,
replicas of the whole model and pipelines, predicts each, measures the finalists side by side and
chooses; :class:`PlanResult` holds the choice, everything considered and why. The modules follow
the steps: ``_checks`` (the arguments), ``_candidates`` (what is considered and predicted),
``_targets`` (planning over several targets), ``_measure`` (building, loading and measuring the
finalists), ``_memory`` (a plan's memory, in a process of its own), ``_rules`` (the pure choice
rules), ``_report`` (the result) and ``_plan`` (the entry).
"""

from onnxpipe.planner._candidates import LoadMeasure, PlanCandidate
from onnxpipe.planner._plan import plan_pipeline
from onnxpipe.planner._report import LoadPlan, PlanResult
from onnxpipe.planner._rules import Contest, LoadChoice, PlanChoice

__all__ = ["Contest", "LoadChoice", "LoadMeasure", "LoadPlan", "PlanCandidate", "PlanChoice", "PlanResult", "plan_pipeline"]
