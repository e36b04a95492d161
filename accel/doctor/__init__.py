"""The doctor: examine your own training step, try the workbook's fixes on a copy of it, measure.

    from accel import doctor
    report = doctor.examine(step, batch)   # step(batch) is your training step, any model
    report                                  # ranked findings, where the time goes
    report.try_fixes()                      # each safe fix alone and together, measured

``python -m accel doctor my_module:make_step`` does the same from a shell (``make_step()``
returns the step and its batch) and writes the report as one HTML file.

How it works: ``reach`` and ``parts`` find everything the step reaches and run it on copies
(your objects never train); ``isolation`` puts the random generators back and names what cannot
be copied (files written), ``untouched`` proves the rest unchanged; ``timeline`` profiles a few steps (kernels, launches, syncs, the device's
idle time by cause); ``recorder`` records every operator of one step with the line of your code
that ran it; the ``check_*`` modules turn that evidence into :class:`Finding`\\ s, each with a
predicted saving from a stated cost model; ``fixes`` and ``trial`` apply and measure the fixes;
``report`` shows it all; ``zoo`` holds small models with planted problems and clean twins;
``ladder`` holds training scripts as first written beside their hand-optimized twins.
"""

from accel.doctor.examine import examine
from accel.doctor.findings import Finding
from accel.doctor.report import Report

__all__ = ["Finding", "Report", "examine"]
