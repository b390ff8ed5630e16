"""Results of a training search: collect.py reads every trial into one ranked table (trial_files.py reads
one trial's outputs, full_run.py the base config); report.py writes final_results/ (CSVs, optimal.py's
full-run config, plots.py's PNGs, and report.md: report_inputs.py takes what it shows from the table,
report_md.py renders it), prints the summary and returns the ranked table
(``report.collect_and_report(results_dir, app)``). The search logs that table to W&B
(hp_tool/search.py ``finalize``): nothing here imports tracking."""
