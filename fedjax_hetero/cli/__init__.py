"""The command line: ``python -m experiments.<dataset>`` (`run`), generated from the settings' declarations
(`flags`), with the papers' presets (`presets`) and each dataset's defaults (`datasets`)."""
