"""The η objective: follow a verl run live, score it, stop bad runs early."""
