"""The applications built on InferScale's library: the ``inferscale`` command line (``cli``), the
terminal chatbot (``chat``), the HTTP server (``server``) and the benchmarks (``bench``).

They sit on top of ``inferscale_engine`` and ``inferscale_integrations`` and use only their public
API; nothing in the library imports from here (``tests/test_import_graph.py`` checks it).
"""
