"""QA records: dataset loaders that write the questions table, and response ids."""
