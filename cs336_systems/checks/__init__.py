"""Correctness checks shared by the tests and the sections: the course's toy models and training a
data-parallel wrapper side by side with single-process training (:mod:`.equivalence`)."""
