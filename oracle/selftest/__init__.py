"""`oracle selftest`: the seeded-fault catalogue (models/faults/) through a backend, judged for detection,
localisation and false alarms; and the conversion defects of shipped files."""

from models import moved

__getattr__ = moved.forward("oracle.selftest")  # the names of the module this package was before 2026-12, for one release
