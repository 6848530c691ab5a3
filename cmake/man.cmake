# Write the man page: `moeaudit help --man` (the CLI prints it from its option
# tables) into OUT. Called by the build with -DCLI=... -DOUT=...
execute_process(COMMAND ${CLI} help --man OUTPUT_FILE ${OUT}.tmp RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  file(REMOVE ${OUT}.tmp)
  message(FATAL_ERROR "${CLI} help --man failed: ${rc}")
endif()
file(RENAME ${OUT}.tmp ${OUT})
