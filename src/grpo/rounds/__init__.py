"""Generation rounds: grouping and scoring a round (`groups`), producing it (`producer`), asynchronous
rounds, evaluation, and stopping on a signal (`preemption`)."""
