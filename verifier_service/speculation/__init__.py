"""The speculation control: `SpeculationControl.plan(view)` and `.observe(report)`
(control.py), over the controller that prices a step's k (controller.py), its measured
costs (costs.py), the step shapes it prices (step_shape.py) and the acceptance it learns
(acceptance.py, route_acceptance.py). Its door types are in verifier_service/records.py."""

from verifier_service.speculation.control import SpeculationControl

__all__ = ["SpeculationControl"]
