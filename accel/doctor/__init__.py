"""The doctor: examine your own training step, try the workbook's fixes on a copy of it, measure.

    from accel import doctor
    report = doctor.examine(step, batch)   # step(batch) is your training step, any model
    report                                  # ranked findings, where the time goes
    report.try_fixes()                      # each safe fix alone and together, measured

``python -m accel doctor my_module:make_step`` does the same from a shell (``make_step()``
returns the step and its batch) and writes the report as one HTML file. Your objects never
train: the step runs on copies (``parts``), the random generators and the files it writes are
put back, and what cannot be (a connection, a process started) is named first in the report.
"""

from accel.doctor.examine import examine
from accel.doctor.findings import Finding
from accel.doctor.report import Report

__all__ = ["Finding", "Report", "examine"]
