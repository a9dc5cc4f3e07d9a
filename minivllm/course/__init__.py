"""The course's machinery (the notebooks live in chapters/, exercises/ and solutions/).

* ``checks``     — the graders exercise notebooks call: a learner's component against the
                   reference on random cases, then inside the real model or engine;
* ``exercises``  — the generator: solutions/NN_topic.ipynb -> exercises/NN_topic.ipynb;
* ``notebooks``  — run a notebook outside Jupyter (refresh committed outputs, tests);
* ``views``      — read-only looks into a running engine (block tables, running requests);
* ``plots``      — plot helpers shared by chapters (the KV block map).

``python -m minivllm.course make-exercises | run`` (see ``__main__``).
"""
