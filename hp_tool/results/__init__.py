"""Results of a training search: collect.py reads every trial into one ranked table (trial_files.py reads
one trial's outputs, full_run.py the base config); report.py writes final_results/ (CSVs, optimal.py's
full-run config, plots.py's PNGs) and prints the summary. Entry point: report.finalize(results_dir, app)."""
