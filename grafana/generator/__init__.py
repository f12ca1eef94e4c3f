"""frexporter's Grafana dashboards as code; ``grafana/generate.py`` is the command line and the API tests use.

The JSON files are build outputs committed for users and the Helm chart (``scripts/sync_chart.py`` copies
them); this package is their only source. Every metric name comes from ``frexporter.naming`` and every
aggregate from a recording rule in ``frexporter/rules/frexporter.rules.yml``, so a rename breaks the generator
or its tests instead of silently emptying a panel.

Layout, each module importing only those above it:

- ``constants``: dashboard uids and file names, variable names, the datasource, sample variable values.
- ``promql``: recording rule names, matchers on the variables, PromQL expressions the panels share.
- ``queries``: ``Target`` (one query of a panel), ``PanelQuery`` and ``Needs`` (the conditions under which a
  query returns data), the metric-name scan and variable substitution tests use.
- ``panels``: SDK panel builders (timeseries, stat, table, state timeline), thresholds, value mappings and
  drill-down links.
- ``board``: ``Board``, a dashboard under construction that numbers panels and registers their queries, and the
  dashboard variables.
- ``job``, ``pg``, ``rank``: one dashboard each, one function per row.
- ``build``: every dashboard's JSON and every panel query (``all_panel_queries`` substitutes the variables).
- ``files``: render, write and ``--check`` the committed JSON; ``main`` is the command line.

Queries are registered as panels are built, each with the conditions under which it returns data (``Needs``).
``all_panel_queries()`` hands them, with the dashboard variables substituted, to tests that check them with
promtool or run them against a real Prometheus scraping a real job.

Dev tooling only: needs ``grafana-foundation-sdk==1769699379!11.6.0`` (the Grafana 11.6 build, schemaVersion
41), which is not a runtime dependency.
"""
