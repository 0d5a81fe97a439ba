"""The old home of the backdoor attack, kept as an import path: see `fedjax_hetero.client.attack`."""

from fedjax_hetero.client.attack import (READINGS, STREAM, AttackedTrainer, AttackInput, Backdoor, BackdoorState,
                                         attack_table, cohort_inputs, malicious_clients, num_malicious, padded_inputs,
                                         poisoned_params, shuffled_row, trainer_wrapper)

__all__ = ["READINGS", "STREAM", "AttackedTrainer", "AttackInput", "Backdoor", "BackdoorState", "attack_table",
           "cohort_inputs", "malicious_clients", "num_malicious", "padded_inputs", "poisoned_params", "shuffled_row",
           "trainer_wrapper"]
